"""Block-quantized FP8 weights, the format of the DeepSeek-V3/V3.1 and Qwen3-FP8 releases: pure tensor functions.

A quantized linear weight W (out x in) is stored as ``float8_e4m3fn`` values q plus a float32 tensor
``weight_scale_inv`` with one entry per block of ``block = (rows, cols)`` (128 x 128 in the releases), of shape
(ceil(out / rows), ceil(in / cols)); the last block of a row or column may be partial. The weight is
``W[i, j] = float32(q[i, j]) * scale_inv[i // rows, j // cols]``, computed in float32 as the releases' reference
dequantization and the engines do. config.json declares the format in ``quantization_config``.
Embeddings, norms, routers and the head are not quantized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "weight_scale_inv"
RELEASE_BLOCK = (128, 128)
_ROW_CHUNK_BYTES = 64 << 20  # float32 temporaries per step of a dequantization / quantization


class Fp8FormatError(ValueError):
    """A quantization_config or a scale tensor that does not describe block-quantized FP8 weights."""


@dataclass(frozen=True)
class BlockFp8:
    """The block format of one checkpoint: block = (rows, cols) of the weight one scale covers."""

    block: tuple[int, int] = RELEASE_BLOCK

    def scale_shape(self, weight_shape) -> tuple[int, int]:
        out, inp = (int(n) for n in weight_shape)
        return math.ceil(out / self.block[0]), math.ceil(inp / self.block[1])

    def config(self) -> dict[str, Any]:
        """``quantization_config`` as the releases write it and vLLM / SGLang / transformers read it."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block)}


def scale_name(weight_name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv``."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name}: only a linear '.weight' has a block scale")
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def parse_quantization_config(cfg: dict[str, Any]) -> BlockFp8 | None:
    """The block format declared by config.json, None for an unquantized checkpoint; anything aloepri cannot
    dequantize exactly is refused in one line."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise Fp8FormatError("quantization_config is not an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise Fp8FormatError(f"quantization method {method!r} is not supported: aloepri reads unquantized "
                             "checkpoints and block-quantized FP8 (quant_method 'fp8'); dequantize the model first")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Fp8FormatError(f"FP8 format {fmt!r} is not supported (only e4m3, float8_e4m3fn)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise Fp8FormatError(f"FP8 weight_block_size {block!r} is not two positive integers; aloepri reads "
                             "block-quantized FP8 (per-tensor FP8 is not supported)")
    return BlockFp8((int(block[0]), int(block[1])))


def check_scale(fmt: BlockFp8, name: str, weight_shape, scale_shape) -> None:
    want = fmt.scale_shape(weight_shape)
    if tuple(int(n) for n in scale_shape) != want:
        raise Fp8FormatError(
            f"tensor {name} ({list(weight_shape)}) has a scale of shape {list(scale_shape)}, but blocks of "
            f"{list(fmt.block)} (quantization_config weight_block_size) need {list(want)}; the config does not "
            "describe these weights")


def _rows_per_step(block_rows: int, cols: int) -> int:
    blocks = max(1, _ROW_CHUNK_BYTES // max(1, 4 * block_rows * cols))
    return blocks * block_rows


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32(q) * scale_inv per block (partial edge blocks included), in float32, returned as ``dtype``.
    Works by bands of row blocks, so the temporaries stay bounded whatever the matrix size."""
    if q.dim() != 2:
        raise Fp8FormatError(f"a block-quantized weight must be 2-D, got shape {list(q.shape)}")
    check_scale(BlockFp8(block), "weight", q.shape, scale_inv.shape)
    out_rows, cols = q.shape
    br, bc = block
    out = torch.empty(out_rows, cols, dtype=torch.float32)
    step = _rows_per_step(br, cols)
    scale = scale_inv.to(torch.float32)
    for r0 in range(0, out_rows, step):
        r1 = min(out_rows, r0 + step)
        s = scale[r0 // br: math.ceil(r1 / br)].repeat_interleave(br, 0)[: r1 - r0]
        s = s.repeat_interleave(bc, 1)[:, :cols]
        torch.mul(q[r0:r1].to(torch.float32), s, out=out[r0:r1])
    return out if dtype == torch.float32 else out.to(dtype)


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scale_inv) with scale_inv = amax(|block|) / 448 per block, so every block
    uses the whole FP8 range; an all-zero block gets a tiny positive scale (its values stay 0). The division runs
    in float32, or in float64 for a float64 weight (one rounding, to FP8)."""
    if w.dim() != 2:
        raise Fp8FormatError(f"only 2-D weights are block-quantized, got shape {list(w.shape)}")
    rows, cols = w.shape
    br, bc = block
    fmt = BlockFp8(block)
    nbr, nbc = fmt.scale_shape(w.shape)
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    scale = torch.empty(nbr, nbc, dtype=torch.float32)
    step = _rows_per_step(br, cols)
    pad_c = nbc * bc - cols
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = w[r0:r1].to(work)
        n = r1 - r0
        pad_r = math.ceil(n / br) * br - n
        xp = torch.nn.functional.pad(x.abs(), (0, pad_c, 0, pad_r)) if (pad_c or pad_r) else x.abs()
        amax = xp.reshape(-1, br, nbc, bc).amax(dim=(1, 3)).to(torch.float32)
        s = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        scale[r0 // br: r0 // br + s.shape[0]] = s
        se = s.to(work).repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :cols]
        q[r0:r1] = (x / se).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fake_quantize(w: torch.Tensor, block: tuple[int, int] = RELEASE_BLOCK) -> torch.Tensor:
    """What an FP8 engine computes with: W quantized to the block format and dequantized, in W's dtype."""
    q, s = quantize_blockwise(w, block)
    return dequantize_blockwise(q, s, block, w.dtype)
