"""The client's plaintext tokenizer. No torch here: the serving client SDK imports this module."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..keyfile import KeyFile
from ..storage.sources import pretrained_kwargs


def load_hf_tokenizer(src: str | Path):
    """The tokenizer of a checkpoint directory or a .gguf file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(**pretrained_kwargs(src))


def load_tokenizer(key: KeyFile, tokenizer: Any = None):
    """The client's plaintext tokenizer: given (an object, or a directory / .gguf path), or from where the key
    says the source checkpoint was; None when neither is available."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if isinstance(tokenizer, (str, Path)):
        tok = load_hf_tokenizer(tokenizer)
    elif key.tokenizer:
        from transformers import AutoTokenizer  # (transformers imports torch: only when a tokenizer is loaded)

        tok = AutoTokenizer.from_pretrained(**dict(key.tokenizer))
    else:
        return None
    if getattr(tok, "chat_template", None) is None and key.chat_template:
        tok.chat_template = key.chat_template
    return tok
