"""Helpers for the tests that run attacks on the tiny random models (attacks/test_attacks_weights.py,
cli/test_device.py)."""
from __future__ import annotations


class IdTokenizer:
    """Stand-in for the tiny models' missing tokenizer: decodes ids to 't<id>' words (text metrics only)."""

    def __init__(self, n: int):
        self.n = n
        self.unk_token_id = 0

    def __len__(self) -> int:
        return self.n

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)
