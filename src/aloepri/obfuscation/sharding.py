"""Can a tensor-parallel engine split the output? The rules vLLM applies when it loads a checkpoint on N GPUs
(SGLang's are the same), checked on the output's widths before any work.

Column-parallel layers (q/k/v, gate/up, MLA's q_b/kv_b, routed and shared experts) split their output rows into N
parts, row-parallel layers (o, down) their input columns; the hidden width (d + 2h) is never split, and the
vocabulary is padded to a multiple of 64 per part by the engine, so neither constrains N. With block-quantized FP8
weights every part must also hold whole blocks: a split output size divisible by the block's rows, a split input
size by its columns; and at any N, the engine's fused projections (q with k before v; gate before up; MLA's q
latent before the kv latent) need every member but the last to be whole blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ShardLayout:
    """The widths of an output model that engines split. ``ffn`` maps a feed-forward name (dense, expert,
    shared expert) to its intermediate size; ``mla`` holds q_lora_rank, qk_nope_head_dim, qk_rope_head_dim and
    v_head_dim for multi-head latent attention (empty for GQA)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: dict[str, int]
    mla: dict[str, int] = field(default_factory=dict)


def layout_of(cfg: dict, mla: bool, head_dim: int, ffn: dict[str, int]) -> ShardLayout:
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    dims = {}
    if mla:
        kv = heads  # MLA: every head has its own k/v, expanded from the shared latent
        dims = {k: int(cfg.get(k) or 0) for k in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    return ShardLayout(heads, kv, head_dim, dict(ffn), dims)


def tensor_parallel_problems(layout: ShardLayout, tp: int, block: tuple[int, int] | None = None) -> list[str]:
    """Why an engine on ``tp`` GPUs cannot load the layout (empty when it can). ``block``: the (rows, cols) of
    block-quantized FP8 weights, None for unquantized ones."""
    problems: list[str] = []
    heads, kv = layout.num_heads, layout.num_kv_heads
    if heads % tp:
        problems.append(f"{heads} attention heads do not split over {tp} GPUs")
    if not layout.mla and kv % tp and tp % kv:
        problems.append(f"{kv} key/value heads neither split over {tp} GPUs nor replicate evenly onto them")
    for name, size in layout.ffn.items():
        if size % tp:
            problems.append(f"{name} intermediate size {size} does not split over {tp} GPUs")
    if problems or block is None:
        return problems

    rows, cols = block

    def whole(size: int, unit: int, what: str, side: str) -> None:
        if size % unit:
            problems.append(f"{what} {size} per GPU is not a multiple of the FP8 block's {unit} {side}")

    if layout.mla:
        m = layout.mla
        q_head, v_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["v_head_dim"]
        if m["q_lora_rank"]:
            whole(m["q_lora_rank"], rows, "q latent (fused with the kv latent) rank", "rows")
        q_out, kv_out, o_in = heads * q_head // tp, heads * (m["qk_nope_head_dim"] + v_head) // tp, heads * v_head // tp
        if tp > 1:
            whole(q_out, rows, "q projection output", "rows")
            whole(kv_out, rows, "kv expansion output", "rows")
    else:
        q_out = heads * layout.head_dim // tp
        kv_out = max(1, kv // tp) * layout.head_dim
        o_in = q_out
        whole(q_out, rows, "q projection output (fused with k and v)", "rows")
        whole(kv_out, rows, "k projection output (fused with v)", "rows")
        if tp > 1:
            whole(kv_out, rows, "v projection output", "rows")
    if tp > 1:
        whole(o_in, cols, "attention output projection input", "columns")
    for name, size in layout.ffn.items():
        whole(size // tp, rows, f"{name} gate projection output (fused with up)", "rows")
        if tp > 1:
            whole(size // tp, cols, f"{name} down projection input", "columns")
    return problems


def check_tensor_parallel(layout: ShardLayout, tp: int, block: tuple[int, int] | None = None) -> None:
    """ValueError with every reason on one line when a TP-``tp`` engine cannot load the layout."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer (the tensor-parallel GPU count), got {tp!r}")
    problems = tensor_parallel_problems(layout, tp, block)
    if problems:
        fmt = f" with FP8 blocks {list(block)}" if block else ""
        raise ValueError(f"a {tp}-GPU tensor-parallel engine cannot load this output{fmt}: " + "; ".join(problems)
                         + (" (choose another --tp or an unquantized --dtype)" if block else " (choose another --tp)"))
