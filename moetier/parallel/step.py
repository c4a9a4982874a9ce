"""Rank 0 runs the engine; the other ranks follow its forwards.

Every forward of a native model's decoder (`model.model(input_ids, positions, cache, batch)`:
a decode step's rows, a packed prefill, whatever the runner builds) runs on every rank with the
same inputs, because each MoE layer combines the ranks' experts (parallel/experts.py). On rank
0 a forward pre-hook (`StepLeader`) broadcasts the forward's inputs (CPU copies of the token
ids, positions and the AttentionBatch's tensors) before the forward runs; each other rank
(`follow`) receives them, runs the same forward on its own KV cache (allocated like rank 0's
the first time rank 0 uses a cache) and waits for the next. Sampling, the scheduler and the
LM head run on rank 0 only. `StepLeader.stop` ends the followers.

Steps run eagerly (no CUDA graph, no torch.compile) under expert parallel for now: a graph
replay bypasses the hook, and the combine is a torch.distributed call.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import traceback
import weakref
from typing import Any

import torch

from moetier.models.attention_batch import AttentionBatch
from moetier.parallel.group import RankGroup

_ARGUMENTS = ("input_ids", "positions", "cache", "batch")


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


class StepLeader:
    """Rank 0's hook on `model.model`: each forward's inputs to the other ranks first."""

    def __init__(self, model: Any, group: RankGroup) -> None:
        self.group = group
        self.forwards = 0
        self._caches: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._handle = model.model.register_forward_pre_hook(self._send, with_kwargs=True)
        self._fatal = model.model.register_forward_hook(_exit_on_error, always_call=True)

    def _cache_key(self, cache: torch.Tensor) -> tuple[int, bool]:
        """(the followers' name of this cache, whether it is new to them)."""
        known = self._caches.get(id(cache))
        if known is not None and known[0]() is cache:
            return known[1], False
        key = len(self._caches)
        self._caches[id(cache)] = (weakref.ref(cache), key)
        return key, True

    def _send(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        given = dict(zip(_ARGUMENTS, args, strict=False))
        given.update(kwargs)
        cache: torch.Tensor = given["cache"]
        batch: AttentionBatch | None = given.get("batch")
        key, new = self._cache_key(cache)
        fields = None
        if batch is not None:
            fields = {f.name: _cpu(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
        self.group.broadcast({
            "kind": "forward",
            "cache": key,
            "new_cache": (tuple(cache.shape), cache.dtype) if new else None,
            "input_ids": _cpu(given["input_ids"]),
            "positions": _cpu(given["positions"]),
            "batch": fields,
        })  # fmt: skip
        self.forwards += 1

    def stop(self) -> None:
        """End the followers' loops (once; the hooks come off)."""
        if self._handle is not None:
            self._handle.remove()
            self._fatal.remove()
            self._handle = None
            self.group.broadcast({"kind": "stop"})


def _exit_on_error(module: Any, args: Any, output: Any) -> None:
    """Rank 0's forward hook, called also when the forward raised (`always_call`): the other
    ranks were told of this forward and wait in its combines, so an error here that the engine
    caught and went on from (a request failed, the server still up) would leave every rank
    stuck until MOETIER_DIST_TIMEOUT. Under expert parallel it ends this process instead, with
    the error on stderr; the launcher (or torchrun) then stops the others."""
    error = sys.exc_info()[1]
    if error is None:
        return
    traceback.print_exc()
    print(
        f"moetier: rank 0 failed inside a forward the other ranks were running with it "
        f"({type(error).__name__}: {error}); expert parallel cannot go on without them: exiting",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


@torch.inference_mode()
def follow(model: Any, group: RankGroup, device: torch.device) -> int:
    """A follower's loop: rank 0's forwards of `model.model`, until it stops. -> forwards run.
    Ctrl-C is rank 0's to handle (it stops the followers), so a follower ignores SIGINT."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    caches: dict[int, torch.Tensor] = {}
    forwards = 0
    while True:
        message = group.broadcast()
        if message["kind"] == "stop":
            return forwards
        if message["new_cache"] is not None:
            shape, dtype = message["new_cache"]
            caches[message["cache"]] = torch.zeros(shape, dtype=dtype, device=device)
        batch = None
        if message["batch"] is not None:
            batch = AttentionBatch(**{
                name: value.to(device) if isinstance(value, torch.Tensor) else value
                for name, value in message["batch"].items()
            })  # fmt: skip
        ids = message["input_ids"].to(device)
        model.model(ids, message["positions"].to(device), caches[message["cache"]], batch)
        forwards += 1
