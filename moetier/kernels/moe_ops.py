"""`torch.ops.moetier.moe_experts`: the public MoE experts op (a torch custom op).

Dispatches to the Triton kernels on CUDA (moe_triton.py) and to the plain-torch twin
(moe_ref.py) on CPU or for formats the kernels do not decode (int2, affine2, nested MXFP4). Being a
custom op with a fake implementation, it traces under torch.compile without graph breaks; it
captures into CUDA graphs where the Triton kernels run it (`triton_supports`): the reference path
syncs with the host.
Formats are passed as small ints from `format_id`, since BlobFormat is not an op argument type.
"""

from __future__ import annotations

import torch

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels.moe_ref import moe_slots_ref

_FORMATS: list[BlobFormat] = []


def format_id(fmt: BlobFormat | None) -> int:
    """A stable small int naming `fmt` for the op (-1 for None)."""
    if fmt is None:
        return -1
    if fmt not in _FORMATS:
        _FORMATS.append(fmt)
    return _FORMATS.index(fmt)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_supports(fmt: BlobFormat, delta_fmt: BlobFormat | None) -> bool:
    """Whether the op runs these formats in the Triton kernels on CUDA (no host syncs, CUDA-graph
    capturable); otherwise it falls back to the reference path, which syncs."""
    if not _triton_available():
        return False
    from moetier.kernels.blob_decode import supports

    return supports(fmt, delta_fmt)


@torch.library.custom_op("moetier::moe_experts", mutates_args=("out", "delta_mask"))
def moe_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_table: torch.Tensor,
    slot_offsets: torch.Tensor,
    pool: torch.Tensor,
    out: torch.Tensor,
    delta_mask: torch.Tensor | None,
    delta_table: torch.Tensor | None,
    base_format: int,
    delta_format: int,
    activation: str,
    act_alpha: float,
    act_limit: float,
    zero_copy: bool = False,
    act_sketch: torch.Tensor | None = None,
    act_coef: torch.Tensor | None = None,
    act_threshold: torch.Tensor | None = None,
) -> None:
    """out[t, j] = topk_weights[t, j] · expert_{topk_ids[t, j]}(hidden[t]) for every pair whose
    expert has a slot (the contract of moe_ref.moe_slots_ref; shapes documented there).

    slot_offsets: [S] int64, byte offset of each slot from pool's first byte (slots in pinned
    host memory are allowed on CUDA); the CPU path requires the plain pool layout
    (slot s at s * pool.stride(0)). zero_copy: some slots are pinned host rows (the kernels
    then take the configs tuned for reads over PCIe; results are the same). act_sketch,
    act_coef, act_threshold: the gate's act term (gate/policies.ActGate): delta_mask is narrowed
    in place per pair by its base hidden activation before the delta is applied (the only
    input the op writes besides `out`)."""
    fmt = _FORMATS[base_format]
    delta_fmt = _FORMATS[delta_format] if delta_format >= 0 else None
    act = ExpertActivation(kind=activation, alpha=act_alpha, limit=act_limit)
    if hidden.is_cuda and triton_supports(fmt, delta_fmt):
        from moetier.kernels.moe_triton import moe_slots_triton

        moe_slots_triton(
            hidden, topk_ids, topk_weights, slot_table, pool, fmt, act, out,
            delta_mask=delta_mask, delta_table=delta_table, delta_fmt=delta_fmt,
            slot_offsets=slot_offsets, zero_copy=zero_copy, act_sketch=act_sketch,
            act_coef=act_coef, act_threshold=act_threshold,
        )  # fmt: skip
        return
    moe_slots_ref(
        hidden, topk_ids, topk_weights, slot_table, pool, fmt, act, out,
        delta_mask=delta_mask, delta_table=delta_table, delta_fmt=delta_fmt,
        act_sketch=act_sketch, act_coef=act_coef, act_threshold=act_threshold,
    )  # fmt: skip


@moe_experts.register_fake
def _(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_table: torch.Tensor,
    slot_offsets: torch.Tensor,
    pool: torch.Tensor,
    out: torch.Tensor,
    delta_mask: torch.Tensor | None,
    delta_table: torch.Tensor | None,
    base_format: int,
    delta_format: int,
    activation: str,
    act_alpha: float,
    act_limit: float,
    zero_copy: bool = False,
    act_sketch: torch.Tensor | None = None,
    act_coef: torch.Tensor | None = None,
    act_threshold: torch.Tensor | None = None,
) -> None:
    return None


@torch.library.custom_op("moetier::sum_pairs", mutates_args=())
def sum_pairs(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [T, k, H] float32 (each pair's weighted expert output) -> [T, H] in `dtype`: the sum
    over each token's k experts by torch's own reduction. An op of its own so torch.compile keeps
    it out of its generated code: in the engine's compiled step with a symbolic row count, the
    generated reduction took 80 µs a layer at 64 rows on an H100 (`bench/serve.py --profile`),
    for a 4 MB read."""
    return out.sum(dim=1).to(dtype)


@sum_pairs.register_fake
def _(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out.new_empty(out.shape[0], out.shape[2], dtype=dtype)
