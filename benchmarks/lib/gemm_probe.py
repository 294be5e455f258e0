"""A float32 2048^3 matmul timed inside the process being measured: the rate a run's figures are compared with.
Self-contained (torch only) so that children run by path under another revision's source can use it."""
from __future__ import annotations

import time


class GemmProbe:
    def __init__(self, n: int = 2048):
        import torch

        self.n = n
        self.a, self.b = torch.randn(n, n), torch.randn(n, n)
        self.c = torch.empty(n, n)
        torch.matmul(self.a, self.b, out=self.c)  # warm-up
        self.gflops: list[float] = []

    def __call__(self) -> float:
        import torch

        t = time.perf_counter()
        torch.matmul(self.a, self.b, out=self.c)
        self.gflops.append(2.0 * self.n ** 3 / (time.perf_counter() - t) / 1e9)
        return self.gflops[-1]
