"""Helpers for the tests that run attacks on the tiny random models (attacks/test_attacks_weights.py,
cli/test_device.py, attacks/test_attacks_behavioural.py)."""
from __future__ import annotations

import numpy as np

from aloepri.attacks.base import PrivateData


def random_private_data(vocab: int, seed: int = 0, low: int = 3) -> PrivateData:
    """Four random 12-token prompts of ids in [low, vocab), every third position marked PII."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(low, vocab, size=12).tolist() for _ in range(4)]
    return PrivateData([""] * 4, ids, [[j % 3 == 0 for j in range(12)] for _ in ids])


class IdTokenizer:
    """Stand-in for the tiny models' missing tokenizer: decodes ids to 't<id>' words (text metrics only)."""

    def __init__(self, n: int):
        self.n = n
        self.unk_token_id = 0

    def __len__(self) -> int:
        return self.n

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)
