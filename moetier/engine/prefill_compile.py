"""Packed steps (prefill chunks, a warm agent turn's new tokens, decodes mixed in) through
torch.compile, with the token and key counts symbolic: one compiled forward serves every chunk
length and context.

Why: an eager packed step costs the host about a hundred kernel launches and their Python a
layer, milliseconds, whatever its length (#42's profile of a warm agent turn on an H100: 3.2 ms
of GPU kernels in 25.5 ms of wall time for 2 layers; docs/benchmarks.md). Compiled, inductor
fuses the norms, rotary, casts and residual adds, and its generated code launches the rest with
less Python on the way; the custom ops (KV page writes, the router, the experts, the masked
attention: kernels/masked_attention.py) stay opaque calls, so the kernels and their numbers
are an eager step's.

Where (with --compile-prefill, off by default: docs/benchmarks.md says why): the CUDA-graph
decode's placement (every expert pinned on the GPU) on families whose
attention takes the compiled path (`prefill_compiles` on the attention module: the GQA
`Attention`); not with zero-copy experts (a long prompt streams the layer's experts, host state
the compiled graph would guard on), hybrid CPU experts, the confidence gate, expert parallelism
or an experts observer (`refusal`). A step of one token runs eagerly (a symbolic count of 1
would specialise a second graph; the paged tables are at least 2 x 2 for the same reason).
Compiled at load on a dummy step whose tokens write the scratch page (`warm_up`), so the first
request finds it ready; inductor's disk cache keeps it for the next start.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from moetier.loader.loaded_model import LoadedModel
from moetier.models.attention_batch import AttentionBatch

# each input's dims that vary from step to step: ids, positions, write_page, write_offset
# [1, N]; the gathered path's mask [1, 1, N, Lk], key_page and key_offset [1, Lk]; the paged
# path's seq_pages [S, W] and blocks [NB, 4]
_DYNAMIC_DIMS = ((1,), (1,), (1,), (1,), (2, 3), (1,), (1,), (0, 1), (0,))
MIN_TOKENS = 2
# what the compiler raises (dynamo's and inductor's errors): the runner then runs packed steps
# eagerly; anything else (out of memory, a kernel's error) is the step's own and propagates
COMPILE_ERRORS: tuple[type[Exception], ...] = (torch._dynamo.exc.TorchDynamoException,)


def refusal(loaded: LoadedModel, with_gate: bool) -> str | None:
    """Why this model's packed steps stay eager (None: they compile)."""
    layers = loaded.model.model.layers
    if not all(getattr(layer.self_attn, "prefill_compiles", False) for layer in layers):
        return "its attention gathers pages or reads sparse keys in Python"
    runtime = loaded.runtime
    if runtime.zero_copy is not None or not runtime.pinned:
        return "experts are read from host RAM"
    if runtime.hybrid is not None or runtime.shard is not None:
        return "experts are split across devices"
    if with_gate:
        return "the confidence gate decides per step"
    return None


class CompiledPrefill:
    """`model.model` (embeddings, layers, final norm) over a packed batch, compiled."""

    def __init__(self, body: Callable[..., torch.Tensor]) -> None:
        def forward(
            ids: torch.Tensor,
            positions: torch.Tensor,
            write_page: torch.Tensor,
            write_offset: torch.Tensor,
            mask: torch.Tensor | None,
            key_page: torch.Tensor | None,
            key_offset: torch.Tensor | None,
            seq_pages: torch.Tensor | None,
            blocks: torch.Tensor | None,
            cache: torch.Tensor,
        ) -> torch.Tensor:
            batch = AttentionBatch(positions, write_page, write_offset, mask, key_page,
                                   key_offset, seq_pages=seq_pages, blocks=blocks)  # fmt: skip
            return body(ids, positions, cache, batch)

        self._forward: Callable[..., torch.Tensor] = torch.compile(forward)
        self.steps = 0  # packed steps run compiled
        self.compile_seconds = 0.0  # warm_up's

    def applies(self, ids: torch.Tensor, runtime: object) -> bool:
        """Whether this step runs compiled: two tokens or more, and no observer on the experts
        (a test's or a trace's, which syncs with the host)."""
        return ids.shape[1] >= MIN_TOKENS and getattr(runtime, "observer", None) is None

    def __call__(
        self, ids: torch.Tensor, batch: AttentionBatch, cache: torch.Tensor
    ) -> torch.Tensor:
        """ids [1, N] and a packed batch (AttentionBatch.packed) -> hidden [1, N, H]; the
        tokens' KV written to `cache` as the eager forward writes it."""
        inputs = [ids, batch.positions, batch.write_page, batch.write_offset, batch.mask,
                  batch.key_page, batch.key_offset, batch.seq_pages, batch.blocks]  # fmt: skip
        for tensor, dims in zip(inputs, _DYNAMIC_DIMS, strict=True):
            for dim in dims if tensor is not None else ():  # (None: the other path's)
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        self.steps += 1
        return self._forward(*inputs, cache)

    def warm_up(
        self, vocab: int, scratch_page: int, page_size: int, cache: torch.Tensor, paged: bool
    ) -> float:
        """Compile on a dummy step of two sequences, 5 tokens after 3 and 70 from 0, every
        position on the scratch page, its batch built as the runner builds its own (`paged`:
        the paged prefill's tables) -> seconds. Every size that varies differs from the others
        (75 tokens; 78 keys, or 2 sequences, 3 blocks and W pages a row), so torch.compile's
        duck sizing gives each its own symbol and later steps reuse this graph."""
        began = time.perf_counter()
        spans = [(3, 5), (0, 70)]
        with torch.inference_mode():  # (as the engine's steps: inference tensors)
            batch = AttentionBatch.packed(
                [(start, count, [scratch_page] * -(-(start + count) // page_size))
                 for start, count in spans],
                page_size, cache.device, paged,
            )  # fmt: skip
            tokens = sum(count for _, count in spans)
            ids = torch.arange(tokens, device=cache.device)[None] % vocab
            self(ids, batch, cache)
        self.steps -= 1
        if cache.is_cuda:
            torch.cuda.synchronize(cache.device)
        self.compile_seconds = time.perf_counter() - began
        return self.compile_seconds
