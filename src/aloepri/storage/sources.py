"""A model source is a Hugging Face checkpoint directory or a single .gguf file; transformers loads both, given
different arguments. This is the one place that tells them apart."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def pretrained_kwargs(src: str | Path) -> dict[str, Any]:
    """``from_pretrained`` arguments for a checkpoint directory, or for a .gguf file (its folder + ``gguf_file``)."""
    p = Path(src)
    if p.is_file():
        return {"pretrained_model_name_or_path": str(p.parent), "gguf_file": p.name}
    return {"pretrained_model_name_or_path": str(p)}
