"""A safetensors file written tensor by tensor and row block by row block, never a whole tensor in memory.

The format puts every tensor's name, dtype, shape and byte range in a JSON header before the data, so a writer that
knows the shapes up front can write the header first and then append the data in order, a slice at a time. That
is what keeps a 128k x 8k vocabulary matrix out of memory: its rows arrive in blocks and go straight to the file.
torch is imported only to turn a tensor into bytes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

DTYPE_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}


class StreamedFile:
    """One safetensors file whose tensors (``entries``: name, dtype name, shape) are appended in the order given,
    each as one or more contiguous row blocks. The file is complete only after ``close()``; a missing or
    oversized block is an error, never a silently short file."""

    def __init__(self, path: str | Path, entries: Sequence[tuple[str, str, Sequence[int]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._order: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            code = DTYPE_CODES[dtype]
            nbytes = math.prod(int(s) for s in shape) * _ITEMSIZE[code]
            header[name] = {"dtype": code, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
        self.total_bytes = offset
        self._file = open(self.path, "wb")
        self._file.write(len(raw).to_bytes(8, "little"))
        self._file.write(raw)
        self._next = 0  # index into _order of the tensor being written
        self._left = self._order[0][1] if self._order else 0

    def write(self, name: str, block) -> None:
        """Append ``block`` (a torch tensor: whole rows of ``name``, in order, in its declared dtype)."""
        import torch

        if self._next >= len(self._order) or self._order[self._next][0] != name:
            expected = self._order[self._next][0] if self._next < len(self._order) else "nothing"
            raise ValueError(f"{self.path.name}: got a block of {name!r}, expected {expected!r}")
        data = block.contiguous().view(torch.uint8).numpy()  # no copy: the buffer protocol hands the bytes on
        if data.nbytes > self._left:
            raise ValueError(f"{self.path.name}: {name} got {data.nbytes - self._left} bytes more than its shape holds")
        self._file.write(data)
        self._left -= data.nbytes
        while self._left == 0 and self._next < len(self._order):
            self._next += 1
            self._left = self._order[self._next][1] if self._next < len(self._order) else 0

    def close(self) -> None:
        if self._next < len(self._order):
            self._file.close()
            raise ValueError(f"{self.path.name}: closed before {self._order[self._next][0]!r} was complete")
        self._file.close()

    def abort(self) -> None:
        self._file.close()
