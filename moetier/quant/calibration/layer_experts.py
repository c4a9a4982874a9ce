"""One MoE layer's experts: statistics from its calibration inputs, quantized, and their output.

Given what the layer's experts module received over the calibration text (hidden x [N, H],
top-k ids and routing weights [N, k]), chunk by chunk of experts: each expert's weights are read
from the checkpoint (dequantised in memory), its statistics gathered on the device, the chunk
quantized at once (q2s by quant/calibration/q2s_batched.py, other codecs per expert), and the
quantized experts' routing-weighted output accumulated, so that the next layer sees what the
quantized model computes. Statistics (each token's x scaled by its routing weight to the expert,
as the layer's output weighs the expert's error):
  gptq  H = sum x x^T, fp32 [K, K] per matrix;  diag  d = mean x^2 per input channel [K]
The down projection's statistics come from the activations of the already-quantized gate_up
(GPTQ's sequential order inside the expert).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moetier.config import ExpertActivation
from moetier.core.layout import MATRICES, BlobFormat, MatrixCodec, TensorSpec, align_up, has_tensor
from moetier.kernels.moe_ref import expert_activation_ref, expert_matrix
from moetier.quant.calibration.q2s_batched import quantize_q2s_batched
from moetier.quant.convert import ExpertsModule, canonical_expert
from moetier.quant.requantize import _encode
from moetier.quant.sources import TensorReader
from moetier.quant.store import BLOB_ALIGN

MODES = ("gptq", "diag")
# What GPTQ makes each matrix reproduce on the quantized model's inputs: its own float weights'
# output ("quantized"), or for down the float expert's output on the same inputs, so down makes
# up for gate_up's error ("expert")
TARGETS = ("quantized", "expert")


@dataclass
class LayerInputs:
    x: torch.Tensor  # [N, H] compute dtype
    ids: torch.Tensor  # [N, k]
    weights: torch.Tensor  # [N, k]


@dataclass
class LayerPlan:
    """How one layer's experts are coded."""

    fmt: BlobFormat
    codecs: dict[str, MatrixCodec]
    mode: str | None  # "gptq", "diag", or None (round to nearest)
    act: ExpertActivation
    delta_fmt: BlobFormat | None = None
    delta_codec: MatrixCodec | None = None
    refine: int = 0  # gptq: rounds of codes re-chosen with the refitted scales held
    target: str = "quantized"  # gptq: TARGETS


def bytes_per_expert(mode: str | None, hidden: int, inter: int, group: int) -> int:
    """Device bytes one expert of a chunk needs at the peak (its gate_up, the larger matrix):
    weights and their working copies, and for gptq the Hessian, its float64 factorisation, the
    inverse factor and the scale refit's per-row systems."""
    n, k = 2 * inter, hidden
    weights = 4 * n * k * 4
    if mode != "gptq":
        return weights + 8 * k
    return weights + 16 * k * k + 4 * n * (k // group) ** 2


def quantize_layer(
    module: ExpertsModule,
    read: TensorReader,
    inputs: LayerInputs | None,
    plan: LayerPlan,
    num_experts: int,
    chunk: int,
    device: torch.device,
    tick: Callable[[int], None] = lambda n: None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """(base blobs, delta blobs (empty without a delta plane), the routed experts' output
    [N, H] in fp32 (None without inputs)). Blobs are CPU uint8 of the aligned stride."""
    routes = _routes(inputs, num_experts) if inputs is not None else None
    out = None
    if inputs is not None:
        out = torch.zeros(inputs.x.shape[0], inputs.x.shape[1], device=device)
    blobs: list[torch.Tensor] = []
    deltas: list[torch.Tensor] = []
    starts = list(range(0, num_experts, chunk))

    def load(e0: int) -> list[dict[str, torch.Tensor]]:
        return [canonical_expert(module, e, read) for e in range(e0, min(num_experts, e0 + chunk))]

    # the next chunk is read from the shards (one thread: the reader is not shared) meanwhile
    with ThreadPoolExecutor(max_workers=1) as reader:
        pending = reader.submit(load, starts[0])
        for i, e0 in enumerate(starts):
            tensors = pending.result()
            if i + 1 < len(starts):
                pending = reader.submit(load, starts[i + 1])
            out = _chunk(tensors, e0, inputs, routes, plan, device, out, blobs, deltas)
            tick(len(tensors))
    return blobs, deltas, out


def _chunk(
    tensors: list[dict[str, torch.Tensor]],
    e0: int,
    inputs: LayerInputs | None,
    routes: tuple[torch.Tensor, torch.Tensor, list[int]] | None,
    plan: LayerPlan,
    device: torch.device,
    out: torch.Tensor | None,
    blobs: list[torch.Tensor],
    deltas: list[torch.Tensor],
) -> torch.Tensor | None:
    """Quantize one chunk of experts (tensors of experts e0, e0 + 1, ...) into `blobs` and
    `deltas`, adding their routing-weighted output to `out`."""
    experts = list(range(e0, e0 + len(tensors)))
    chunk_blobs = [torch.zeros(align_up(plan.fmt.nbytes, BLOB_ALIGN), dtype=torch.uint8)
                   for _ in experts]  # fmt: skip
    chunk_deltas = []
    if plan.delta_fmt is not None:
        stride = align_up(plan.delta_fmt.nbytes, BLOB_ALIGN)
        chunk_deltas = [torch.zeros(stride, dtype=torch.uint8) for _ in experts]
    for name in ("gate_up_bias", "down_bias"):
        if has_tensor(plan.fmt, name):
            for blob, t in zip(chunk_blobs, tensors, strict=True):
                _put(blob, plan.fmt.tensor(name), t[name])
    rows = [_rows(routes, e) for e in experts] if routes is not None else None
    x_in = None
    if inputs is not None and rows is not None:
        x_in = [(inputs.x[r].float() * w[:, None]) for r, w in rows]  # weighted inputs
    float_in = None  # target "expert": down's inputs in the float expert
    for name in MATRICES:
        w = torch.stack([t[name] for t in tensors]).to(device).float()  # [C, N, K]
        stats = _statistics(x_in, plan.mode, w.shape[2], device)
        target = w
        if float_in is not None and x_in is not None and stats is not None:
            target = _compensated(w, float_in, x_in, stats)
        _code_matrix(plan, name, w, stats, chunk_blobs, chunk_deltas, device, target)
        if name == "gate_up" and x_in is not None and inputs is not None and rows is not None:
            # inputs of down: the quantized gate_up's activations, routing-weighted as x was
            if plan.mode == "gptq" and plan.target == "expert":
                # and the float gate_up's on the same inputs, weighted alike
                float_in = [
                    _float_act(inputs.x[r].float(), w[i], tensors[i].get("gate_up_bias"), plan)
                    * wt[:, None]
                    for i, (r, wt) in enumerate(rows)
                ]
            acts = []
            for i, blob in enumerate(chunk_blobs):
                r, wt = rows[i]
                acts.append(_activation(inputs.x[r].float(), blob, plan, device) * wt[:, None])
            x_in = acts
        del w, stats
    if out is not None and x_in is not None and rows is not None:
        for i, blob in enumerate(chunk_blobs):
            r, _ = rows[i]
            if r.numel():
                down = expert_matrix(blob.to(device), plan.fmt, "down")  # [H, I]
                y = x_in[i] @ down.T  # x_in holds w * act: the weighted output
                if has_tensor(plan.fmt, "down_bias"):
                    bias = _bias(blob, plan.fmt, "down_bias", device)
                    y = y + rows[i][1][:, None] * bias
                out[r] += y  # a token once per expert: no atomics, the same sum on any run
    blobs += chunk_blobs
    deltas += chunk_deltas
    return out


def _routes(inputs: LayerInputs, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(token of each routed pair, its weight) sorted by expert, and each expert's start."""
    n, k = inputs.ids.shape
    experts = inputs.ids.reshape(-1).long()
    order = torch.argsort(experts, stable=True)
    tokens = torch.arange(n, device=experts.device).repeat_interleave(k)[order]
    weights = inputs.weights.reshape(-1).float()[order]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return tokens, weights, starts


def _rows(
    routes: tuple[torch.Tensor, torch.Tensor, list[int]], e: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, weights, starts = routes
    return tokens[starts[e] : starts[e + 1]], weights[starts[e] : starts[e + 1]]


def _float_act(
    x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None, plan: LayerPlan
) -> torch.Tensor:
    h = x @ gate_up.T
    if bias is not None:
        h = h + bias.to(h.device).float()
    gate, up = h.chunk(2, dim=-1)
    return expert_activation_ref(gate, up, plan.act)


def _compensated(
    w: torch.Tensor, float_acts: list[torch.Tensor], acts: list[torch.Tensor], h: torch.Tensor,
    damp: float = 0.01,
) -> torch.Tensor:  # fmt: skip
    """The down matrices the quantized inputs call for: per expert the least-squares
    W* = W A^T Â (Â^T Â)^-1 = W + W (A - Â)^T Â (Â^T Â)^-1 (damped), so that
    ||A W^T - Â Ŵ^T||² = ||Â (W* - Ŵ)^T||² + const and GPTQ on W* with H = Â^T Â minimises the
    error of the expert's output against the float expert's (not against W applied to the
    quantized inputs). W* = W where the inputs agree."""
    out = w.clone()
    k = w.shape[2]
    eye = torch.eye(k, device=w.device, dtype=torch.float64)
    for i, (a, ah) in enumerate(zip(float_acts, acts, strict=True)):
        if a.shape[0] == 0:
            continue
        assert a.shape == ah.shape
        hd = h[i].double()
        hd = hd + damp * hd.diagonal().mean() * eye
        c = (a.double() - ah.double()).T @ ah.double()  # [K, K]
        out[i] = (w[i].double() + w[i].double() @ c @ torch.linalg.inv(hd)).float()
    return out


def _statistics(
    x_in: list[torch.Tensor] | None, mode: str | None, k: int, device: torch.device
) -> torch.Tensor | None:
    """[C, K, K] Hessians (gptq) or [C, K] mean squares (diag) of the weighted inputs. An
    expert no calibration token reached gets the identity (gptq) or ones (diag): rounded as
    without statistics (an all-zero statistic would mark every input channel dead)."""
    if x_in is None or mode is None:
        return None
    if mode == "gptq":
        h = torch.eye(k, device=device).repeat(len(x_in), 1, 1)
        for i, x in enumerate(x_in):
            if x.shape[0]:
                h[i] = x.T @ x
        return h
    d = torch.ones(len(x_in), k, device=device)
    for i, x in enumerate(x_in):
        if x.shape[0]:
            d[i] = (x * x).mean(dim=0)
    return d


def _code_matrix(
    plan: LayerPlan,
    name: str,
    w: torch.Tensor,
    stats: torch.Tensor | None,
    blobs: list[torch.Tensor],
    deltas: list[torch.Tensor],
    device: torch.device,
    target: torch.Tensor | None = None,
) -> None:
    """Quantize matrix `name` of a chunk's experts into their blobs (and delta blobs)."""
    parts = _encode_chunk(
        plan.codecs[name], w if target is None else target, stats, plan.mode, plan.refine
    )
    for blob, p in zip(blobs, parts, strict=True):
        for part, value in p.items():
            _put(blob, plan.fmt.tensor(f"{name}.{part}"), value)
    if plan.delta_fmt is None or plan.delta_codec is None:
        return
    residual = torch.stack(
        [w[i] - expert_matrix(blob.to(device), plan.fmt, name) for i, blob in enumerate(blobs)]
    )
    delta_stats = stats if plan.delta_codec.kind == "q2s" else None
    for blob, p in zip(deltas, _encode_chunk(plan.delta_codec, residual, delta_stats, plan.mode,
                                         plan.refine),
                       strict=True):  # fmt: skip
        for part, value in p.items():
            _put(blob, plan.delta_fmt.tensor(f"{name}.{part}"), value)


def _encode_chunk(
    codec: MatrixCodec,
    w: torch.Tensor,
    stats: torch.Tensor | None,
    mode: str | None,
    refine: int = 0,
) -> list[dict[str, torch.Tensor]]:
    if codec.kind == "q2s":
        q = quantize_q2s_batched(
            w,
            hessian=stats if mode == "gptq" else None,
            importance=stats if mode == "diag" else None,
            group=codec.group,
            refine=refine,
        )
        return [q.parts(i) for i in range(w.shape[0])]
    # the other codecs round to nearest, one expert at a time (quant/requantize.py)
    return [_encode(codec, w[i].cpu(), None) for i in range(w.shape[0])]


def _activation(
    x: torch.Tensor, blob: torch.Tensor, plan: LayerPlan, device: torch.device
) -> torch.Tensor:
    gate_up = expert_matrix(blob.to(device), plan.fmt, "gate_up")  # [2I, H] as decoded
    h = x @ gate_up.T
    if has_tensor(plan.fmt, "gate_up_bias"):
        h = h + _bias(blob, plan.fmt, "gate_up_bias", device)
    gate, up = h.chunk(2, dim=-1)
    return expert_activation_ref(gate, up, plan.act)


def _bias(blob: torch.Tensor, fmt: BlobFormat, name: str, device: torch.device) -> torch.Tensor:
    spec = fmt.tensor(name)
    raw = blob[spec.offset : spec.offset + spec.nbytes].clone()
    from moetier.core.layout import DTYPES

    return raw.view(DTYPES[spec.dtype]).view(spec.shape).to(device).float()


def _put(blob: torch.Tensor, spec: TensorSpec, value: torch.Tensor) -> None:
    blob[spec.offset : spec.offset + spec.nbytes] = (
        value.detach().cpu().contiguous().view(-1).view(torch.uint8)
    )
