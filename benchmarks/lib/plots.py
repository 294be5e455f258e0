"""One figure written beside an experiment's results (matplotlib without a display)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def figure(path: Path, size: tuple[float, float] = (6, 4), dpi: int = 120) -> Iterator:
    """Yields the axes of a new figure; on exit lays it out, writes it to ``path`` and frees it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
