"""Hybrid misses inside a captured decode step: a MoE layer's CPU pairs as graph nodes.

`moetier::cpu_part_start` (after the router, before the GPU experts kernel) packs the pairs whose
expert is flagged (`flags` [E] bool; padding rows' pairs never) into pinned buffers at fixed
size: [count, pair[T·k], blob[T·k]] int64 (pair = token·k + k index, blob = the expert's host
address, flagged pairs first) and [weight[T·k], x[T·H]] float32. The C entry point
`mt_host_pairs` (q2s_experts.c) reads them and writes [T, k, H] float32 rows, zero for other
pairs, into a pinned output buffer; `moetier::cpu_part_join` (after the GPU kernel) adds them
into the op's [T, k, H] output before the sum over k. Torch ops only (sort, gather, cat,
copies): no host sync, no data-dependent shape, so the step stays capturable.

On CUDA the pack and its copies into the pinned buffers run on the current stream; the C call
is a host function queued on a side stream forked from it (`host_node.launch_host_func`: a host
node when captured), the rows go back to a device buffer on that stream, and the join waits for
it by an event: the GPU kernel on the main stream runs meanwhile. The side stream touches only
the part's own buffers (no tensor of the current stream's allocator). On CPU (fixed-shape
steps, eager) the same C entry point runs on the same buffers in `start`. The C call counts its
pairs, distinct blobs, calls and nanoseconds in its user-data struct (a captured step touches
no Python state).

Knows nothing of placement: which experts are flagged is the caller's (residency/hybrid_graph).
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field

import torch

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels.cpu.dram import get_threads
from moetier.kernels.cpu.experts import ACT_KINDS, ROWS_PER_TASK, _e4m3_table, _layout

TOKENS_RESERVED = 64  # buffers sized at first for steps of this many rows (the graphs' largest)
_IDS = itertools.count()


class HostCall(ctypes.Structure):
    """`MtHostCall` of q2s_experts.c (same field order and types)."""

    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("count", ctypes.c_void_p),
        ("pair", ctypes.c_void_p),
        ("blob", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("gate_up", ctypes.c_int64 * 7),
        ("down", ctypes.c_int64 * 7),
        ("gate_up_bias", ctypes.c_int64),
        ("down_bias", ctypes.c_int64),
        ("lut", ctypes.c_void_p),
        ("act", ctypes.c_int),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
        ("rows_per_task", ctypes.c_int64),
        ("threads", ctypes.c_int),
        ("status", ctypes.c_int),
        ("pairs", ctypes.c_int64),
        ("blobs", ctypes.c_int64),
        ("calls", ctypes.c_int64),
        ("nanos", ctypes.c_int64),
    ]


@dataclass
class _Buffers:
    """Pinned (CUDA) or plain (CPU) buffers for steps of up to `tokens` rows."""

    tokens: int
    ints: torch.Tensor  # [1 + 2·T·k] int64
    floats: torch.Tensor  # [T·k + T·H] float32
    out: torch.Tensor  # [T·k·H] float32, the C call's rows
    rows: torch.Tensor | None  # [T·k·H] float32 on the GPU (CUDA), the rows brought back


@dataclass
class _Call:
    struct: HostCall
    buffers: _Buffers


@dataclass
class Counters:
    pairs: int = 0
    blobs: int = 0
    calls: int = 0
    seconds: float = 0.0
    failed: int = 0  # calls that could not allocate their scratch memory


@dataclass
class CpuPart:
    """The C entry point over packed buffers for the MoE layers in `formats` (each a format the
    C kernel runs: `experts.cpu_supports`); `top_k`, `hidden` the model's."""

    formats: dict[int, BlobFormat]
    activation: ExpertActivation
    top_k: int
    hidden: int
    device: torch.device
    part_id: int = field(default_factory=lambda: next(_IDS))
    _buffers: _Buffers | None = None
    _calls: dict[tuple[int, int], _Call] = field(default_factory=dict)
    _events: dict[int, torch.cuda.Event] = field(default_factory=dict)
    _side: torch.cuda.Stream | None = None

    def __post_init__(self) -> None:
        from moetier.kernels.cpu.build import load

        lib = load()
        if lib is None:
            raise ValueError("no C compiler built the CPU expert kernel")
        self.lib = lib
        function = ctypes.cast(lib.mt_host_pairs, ctypes.c_void_p).value
        assert function is not None
        self.function: int = function
        self.ticket = torch.zeros(1, dtype=torch.int64, device=self.device)
        _PARTS[self.part_id] = self
        self._grow(TOKENS_RESERVED)

    def _grow(self, tokens: int) -> _Buffers:
        """Buffers for `tokens` rows (kept: captured steps and older calls hold their
        addresses)."""
        cuda = self.device.type == "cuda"
        pairs, h = tokens * self.top_k, self.hidden

        def host(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=cuda)

        rows = torch.zeros(pairs * h, device=self.device) if cuda else None
        self._buffers = _Buffers(tokens, host(1 + 2 * pairs, torch.int64),
                                 host(pairs + tokens * h, torch.float32),
                                 host(pairs * h, torch.float32), rows)  # fmt: skip
        _KEPT.append(self._buffers)
        return self._buffers

    def call(self, layer: int, tokens: int) -> _Call:
        """The C call's struct for `layer` at `tokens` rows (made once, over the buffers of its
        time)."""
        found = self._calls.get((layer, tokens))
        if found is not None:
            return found
        buffers = self._buffers
        if buffers is None or buffers.tokens < tokens:
            buffers = self._grow(max(tokens, 2 * (buffers.tokens if buffers else 0)))
        pairs = tokens * self.top_k
        gate_up, down, biases = _layout(self.formats[layer])
        ints, floats = buffers.ints.data_ptr(), buffers.floats.data_ptr()
        act = self.activation
        struct = HostCall(
            tokens, self.top_k, ints, ints + 8, ints + 8 * (1 + pairs), floats,
            floats + 4 * pairs, buffers.out.data_ptr(), (ctypes.c_int64 * 7)(*gate_up.tolist()),
            (ctypes.c_int64 * 7)(*down.tolist()), biases[0], biases[1],
            _e4m3_table().ctypes.data, ACT_KINDS[act.kind], act.alpha, act.limit,
            ROWS_PER_TASK, get_threads(),
        )  # fmt: skip
        self._calls[(layer, tokens)] = _Call(struct, buffers)
        return self._calls[(layer, tokens)]

    def counters(self) -> Counters:
        """What the C calls did so far (read from their structs)."""
        out = Counters()
        for call in self._calls.values():
            s = call.struct
            out.pairs += s.pairs
            out.blobs += s.blobs
            out.calls += s.calls
            out.seconds += s.nanos / 1e9
            out.failed += s.status != 0
        return out

    def start(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        flags: torch.Tensor,
        addresses: torch.Tensor,
        live: torch.Tensor | None,
    ) -> None:
        tokens, top_k = topk_ids.shape
        call = self.call(layer, tokens)
        pairs = tokens * top_k
        buffers = call.buffers
        cuda = self.device.type == "cuda"
        # the pack and its copies into the pinned buffers on the current stream: on CUDA the
        # side stream then touches only this part's own buffers. (Packed there, it read
        # hidden, topk_ids, ... of the current stream's allocator, which may hand their memory
        # to a later op of the current stream before the side stream has read them: in a
        # captured step, a race without an edge.)
        ints, floats = _pack(hidden, topk_ids, topk_weights, flags, addresses, live)
        buffers.ints[: ints.numel()].copy_(ints, non_blocking=cuda)
        buffers.floats[: floats.numel()].copy_(floats, non_blocking=cuda)
        if not cuda:
            self.lib.mt_host_pairs(ctypes.byref(call.struct))
            if call.struct.status != 0:
                raise MemoryError("the C CPU expert kernel could not allocate its scratch memory")
            return
        from moetier.kernels.cpu.host_node import launch_host_func

        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side, event = self._side, self._events.setdefault(layer, torch.cuda.Event())
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            launch_host_func(side, self.function, ctypes.addressof(call.struct))
            assert buffers.rows is not None
            n = pairs * self.hidden
            buffers.rows[:n].copy_(buffers.out[:n], non_blocking=True)
            event.record(side)

    def join(self, layer: int, out: torch.Tensor) -> None:
        tokens, top_k, h = out.shape
        buffers = self.call(layer, tokens).buffers
        n = tokens * top_k * h
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self._events[layer])
            assert buffers.rows is not None
            out.add_(buffers.rows[:n].view(tokens, top_k, h))
        else:
            out.add_(buffers.out[:n].view(tokens, top_k, h))


_PARTS: dict[int, CpuPart] = {}
_KEPT: list[_Buffers] = []  # every buffer a struct may point at lives as long as the process


def _pack(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    flags: torch.Tensor,
    addresses: torch.Tensor,
    live: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ([count, pair[P], blob[P]] int64, [weight[P], x[T·H]] float32), P = T·k, the
    flagged pairs first (in pair order), on hidden's device; no host sync."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    flag = flags[flat]
    if live is not None:  # padding rows: none of their pairs
        flag = flag & live[:, None].expand(tokens, top_k).reshape(-1)
    order = torch.sort(flag.to(torch.uint8), descending=True, stable=True).indices
    count = flag.sum().view(1).to(torch.int64)
    ints = torch.cat([count, order, addresses[flat[order]]])
    weights = topk_weights.reshape(-1)[order].float()
    floats = torch.cat([weights, hidden.detach().float().reshape(-1)])
    return ints, floats


@torch.library.custom_op("moetier::cpu_part_start", mutates_args=("ticket",))
def cpu_part_start(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    flags: torch.Tensor,
    addresses: torch.Tensor,
    live: torch.Tensor | None,
    ticket: torch.Tensor,
    part_id: int,
    layer: int,
) -> None:
    """Pack layer `layer`'s flagged pairs and run (CPU) or queue (CUDA) the C call over them
    (module docstring). `ticket` (the part's) is not read: declared mutated, it orders this op
    before `cpu_part_join` under torch.compile."""
    _PARTS[part_id].start(layer, hidden, topk_ids, topk_weights, flags, addresses, live)


@cpu_part_start.register_fake
def _(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    flags: torch.Tensor,
    addresses: torch.Tensor,
    live: torch.Tensor | None,
    ticket: torch.Tensor,
    part_id: int,
    layer: int,
) -> None:
    return None


@torch.library.custom_op("moetier::cpu_part_join", mutates_args=("out",))
def cpu_part_join(out: torch.Tensor, ticket: torch.Tensor, part_id: int, layer: int) -> None:
    """out [T, k, H] float32 += the C call's rows of `cpu_part_start` (waiting for them on
    CUDA)."""
    _PARTS[part_id].join(layer, out)


@cpu_part_join.register_fake
def _(out: torch.Tensor, ticket: torch.Tensor, part_id: int, layer: int) -> None:
    return None
