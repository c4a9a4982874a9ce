"""Where the experts go so that a decode step can be captured in a CUDA graph (no host syncs),
and the bookkeeping between captured steps. Shared by the Generator (engine/generate.py) and
the serving engine's PagedRunner (engine/runner.py).

`place_for_graphs`: every expert pinned in a GPU slot when they all fit the expert cache; else,
with a host tier (--host-memory), zero-copy: the most used in GPU slots, the rest read by the
kernel from pinned host RAM, optionally with staging slots that take each next layer's guessed
experts, and with --cpu-experts the cold experts' pairs computed by the host's cores in the
step (residency/hybrid_graph.py); else no graphs (eager steps, misses fetched).
`ZeroCopyRebalance` moves the hot set between steps, and chooses the CPU's experts again: after
each prefill-like step (many tokens' counts) and every ZERO_COPY_REBALANCE_TOKENS decode steps.
"""

from __future__ import annotations

import sys

import torch

from moetier.loader.loaded_model import LoadedModel
from moetier.models.experts import ExpertsRuntime, router_weights
from moetier.residency.zero_copy import staging_slots

# Zero-copy decode: decode steps between two moves of the GPU-resident hot set (a host read of
# the device-side counts and copies of the promoted blobs, between graph replays).
ZERO_COPY_REBALANCE_TOKENS = 64


def place_for_graphs(loaded: LoadedModel) -> bool:
    """Put the experts where a captured step reads them without host syncs (module docstring);
    False (eager steps) when neither fits, with a line on stderr saying why."""
    runtime = loaded.runtime
    if runtime.pinned or runtime.zero_copy is not None:
        return True
    try:
        runtime.pin_all()
    except ValueError as exc:
        if runtime.residency.host is None:
            hint = "--host-memory would read the others from host RAM without host syncs"
            print(f"moetier: decoding without CUDA graphs ({exc}; {hint})", file=sys.stderr)
            return False
        why = runtime.hybrid_graph_refusal() if runtime.hybrid is not None else None
        if why is not None:  # --cpu-experts' split runs on eager steps only here
            why = f"--cpu-experts splits misses on eager steps: {why}"
            print(f"moetier: decoding without CUDA graphs ({exc}; {why})", file=sys.stderr)
            return False
        try:
            stage, guesses = _staging(loaded, runtime)
            runtime.enable_zero_copy(stage=stage, delta_slots=delta_slots(loaded))
        except ValueError as zc_exc:
            print(f"moetier: decoding without CUDA graphs ({zc_exc})", file=sys.stderr)
            return False
        if guesses is not None:
            # guesses from each layer's output where the layers hand it over (native models):
            # on the H200 decode bench 621-626 tok/s against 595 from the input
            runtime.enable_prefetch(
                *guesses, guess_from="output" if runtime.layer_outputs else "input"
            )
        note = "the most used stay in GPU slots, the others are read from pinned host RAM"
        print(f"moetier: the experts do not all fit the GPU cache: {note}", file=sys.stderr)
        if runtime.hybrid is not None:
            _split_on_graphs(runtime)
        return True
    runtime.residency.host = None  # every blob is on the GPU: free the pinned host copies
    return True


def _split_on_graphs(runtime: ExpertsRuntime) -> None:
    """--cpu-experts on the zero-copy step: cold experts' pairs computed by the host's cores in
    a host node (residency/hybrid_graph.py); where CUDA cannot capture that node, the step
    reads every miss from host RAM instead (one line on stderr)."""
    graph = runtime.enable_hybrid_graph()
    if runtime.residency.device.type != "cuda":
        return
    import ctypes

    from moetier.kernels.cpu.host_node import capture_works

    part = graph.part
    probe = part.call(min(runtime.formats), 1).struct  # (its buffers hold count 0: no work)
    why = capture_works(part.function, ctypes.addressof(probe), runtime.residency.device)
    if why is not None:
        runtime.disable_hybrid_graph()
        print(f"moetier: CUDA-graph decode steps read every miss from pinned host RAM, without "
              f"--cpu-experts' CPU split (capturing its host node failed: {why})",
              file=sys.stderr)  # fmt: skip


def delta_slots(loaded: LoadedModel) -> int | None:
    """--delta-memory in expert slots (None: not given, the planes share the cache)."""
    text = loaded.engine_config.delta_memory
    if not text:
        return None
    from moetier.residency.planner import parse_bytes

    slot = loaded.runtime.residency.slot_bytes
    return parse_bytes(text) // slot


def _staging(
    loaded: LoadedModel, runtime: ExpertsRuntime
) -> tuple[int, tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None]:
    """Zero-copy staging slots per MoE layer (--zero-copy-stage, at most a quarter of the expert
    cache; 0 where the routers cannot guess) and the routers and norms to guess with."""
    layers = sorted(runtime.formats)
    stage = staging_slots(
        loaded.engine_config.zero_copy_stage, runtime.residency.capacity, len(layers)
    )
    if stage <= 0:
        return 0, None
    try:
        return stage, router_weights(loaded.model, layers)
    except ValueError:
        return 0, None


class ZeroCopyRebalance:
    """Between steps: count the pinned path's pairs (a captured step counts nothing itself)
    and, in zero-copy mode, move the hot set after a step of many tokens a sequence (a
    prefill: its counts show where the decode goes) and every ZERO_COPY_REBALANCE_TOKENS
    steps. `step` is told of each forward (its tokens, whether it was a prefill) just before or
    just after it runs: a move happens between two of them."""

    def __init__(self, runtime: ExpertsRuntime) -> None:
        self.runtime = runtime
        self.steps = 0
        self._prefill_before = False
        self._decode_tokens = self._decode_steps = 0  # since the last move (the CPU split's)

    def step(self, tokens: int, prefill: bool) -> None:
        self.runtime.count_pinned(tokens)  # no-op unless every expert is pinned
        zero_copy = self.runtime.zero_copy
        if zero_copy is None:
            return
        if self._prefill_before or (self.steps and self.steps % ZERO_COPY_REBALANCE_TOKENS == 0):
            zero_copy.rebalance()
            split = self.runtime.hybrid_graph
            if split is not None:  # --cpu-experts: the CPU's experts chosen again
                steps = self._decode_steps
                split.mark(self._decode_tokens / steps if steps else None)
                self._decode_tokens = self._decode_steps = 0
        if not prefill:
            self._decode_tokens += tokens
            self._decode_steps += 1
        self.steps += 1
        self._prefill_before = prefill
