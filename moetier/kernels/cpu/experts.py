"""The CPU expert kernel: a step's CPU-assigned (token, expert) pairs computed by the host's cores
straight from the blobs' bytes in host memory (the pinned host tier's rows), with no dequantised
copy of an expert: gate_up, the family's activation, down, times the routing weight.

`cpu_experts` picks a backend per call ("auto"):
  c      q2s_experts.c, built by the host's C compiler at first use (build.py): activations
         rounded to int8 per word of 16 columns, 2-bit codes times activations by VPDPBUSD
         (AVX-512 VNNI) or PMADDUBSW (AVX2), plain C elsewhere; OpenMP threads over blocks of
         rows of all the call's experts, so one pair keeps every core busy. q2s blobs whose K's
         and groups are multiples of 16. Its twin: `cpu_experts_ref(..., act_int8=True)`.
  torch  the twin `cpu_experts_ref` itself: every format (bf16, NVFP4, other q2s shapes), and
         every blob where no C compiler is found.
Blobs are named by their host address (`HostTier.address`), read in place.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat, blob_view, has_tensor, matrix_codecs
from moetier.kernels.cpu.dram import get_threads
from moetier.kernels.moe_ref import expert_activation_ref, expert_matrix, quant_words_ref

ACT_KINDS = {"silu": 0, "silu_clamped": 1, "gpt_oss": 2}
ROWS_PER_TASK = 128  # rows of one matrix a work item takes at most (the kernel takes fewer
# where a call has too few experts to give every thread 4 items)
BACKENDS = ("c", "torch")
_LOCK = threading.Lock()  # the C entry point sorts through one static key pointer


@functools.cache
def _q2s_shape(fmt: BlobFormat) -> tuple[int, int, int, int] | None:
    """(hidden, intermediate, gate_up group, down group) of a blob format whose matrices are
    both q2s with float32 biases or none; None otherwise."""
    codecs = matrix_codecs(fmt)
    if codecs is None or any(c.kind != "q2s" for c in codecs.values()):
        return None
    if has_tensor(fmt, "gate_up_bias") and fmt.tensor("gate_up_bias").dtype != "float32":
        return None
    hidden, inter = fmt.tensor("down.codes").shape[0], fmt.tensor("down.codes").shape[1] * 4
    return hidden, inter, codecs["gate_up"].group, codecs["down"].group


def cpu_supports(fmt: BlobFormat, backend: str = "c", march: str = "native") -> bool:
    """Whether `backend` runs blobs of `fmt`: torch every format; c q2s blobs (both matrices,
    float32 biases or none) whose K's and groups are multiples of 16, where a C compiler built
    the kernel."""
    if backend == "torch":
        return True
    if backend != "c":
        raise ValueError(f"CPU kernel backends are {', '.join(BACKENDS)}, not {backend!r}")
    shape = _q2s_shape(fmt)
    if shape is None or any(v % 16 for v in shape):
        return False
    from moetier.kernels.cpu.build import load

    return load(march) is not None


def choose_backend(fmt: BlobFormat) -> str:
    """The fastest backend that runs `fmt`: c, else torch."""
    return "c" if cpu_supports(fmt, "c") else "torch"


def blob_at(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 [nbytes] CPU tensor over host memory at `address` (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def cpu_experts_ref(
    hidden: torch.Tensor,
    pair_token: torch.Tensor,
    pair_weight: torch.Tensor,
    pair_blob: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    act_int8: bool = False,
) -> torch.Tensor:
    """The twin: [P, H] float32, row p = pair_weight[p] · expert(hidden[pair_token[p]]), the
    expert's blob at host address `pair_blob[p]`, decoded by moe_ref.expert_matrix and run in
    float32. act_int8: both matrices' inputs rounded to int8 words first (`quant_words_ref`), as
    the C kernel does."""
    x = hidden.detach().float().cpu()
    out = torch.zeros(pair_token.numel(), hidden.shape[1], dtype=torch.float32)
    blobs: dict[int, list[int]] = {}
    for p, address in enumerate(pair_blob.tolist()):
        blobs.setdefault(address, []).append(p)
    for address, pairs in blobs.items():
        blob = blob_at(address, fmt.nbytes)
        rows = torch.tensor(pairs)
        xin = x[pair_token.cpu()[rows]]
        if act_int8:
            xin = quant_words_ref(xin)
        h = F.linear(xin, expert_matrix(blob, fmt, "gate_up"))
        if has_tensor(fmt, "gate_up_bias"):
            h = h + blob_view(blob, fmt.tensor("gate_up_bias")).float()
        gate, up = h.chunk(2, dim=-1)
        h = expert_activation_ref(gate, up, act)
        if act_int8:
            h = quant_words_ref(h)
        y = F.linear(h, expert_matrix(blob, fmt, "down"))
        if has_tensor(fmt, "down_bias"):
            y = y + blob_view(blob, fmt.tensor("down_bias")).float()
        out[rows] = y * pair_weight.cpu()[rows, None].float()
    return out


def cpu_experts(
    hidden: torch.Tensor,
    pair_token: torch.Tensor,
    pair_weight: torch.Tensor,
    pair_blob: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    backend: str = "auto",
    march: str = "native",
) -> torch.Tensor:
    """The pairs' expert outputs [P, H] float32 (see `cpu_experts_ref`), computed on the host's
    cores with the threads `dram.set_threads` gave. hidden [T, H] CPU, any float dtype; pair_*
    [P] CPU (token index, routing weight, blob address). backend: one of BACKENDS or "auto"
    (`choose_backend`); march: the C build's -march (tests)."""
    if backend == "auto":
        backend = choose_backend(fmt)
    if backend == "torch" or pair_token.numel() == 0:
        return cpu_experts_ref(hidden, pair_token, pair_weight, pair_blob, fmt, act)
    if not cpu_supports(fmt, backend, march):
        raise ValueError(f"the {backend} CPU kernel does not run {fmt.name} blobs")
    from moetier.kernels.cpu.build import load

    lib = load(march)
    assert lib is not None
    x = hidden.detach().float().contiguous()
    blobs = pair_blob.to(torch.int64).contiguous()
    token = pair_token.to(torch.int64).contiguous()
    weight = pair_weight.to(torch.float32).contiguous()
    gate_up, down, biases = _layout(fmt)
    out = torch.empty(token.numel(), x.shape[1], dtype=torch.float32)
    with _LOCK:
        status = lib.mt_q2s_pairs(
            token.numel(), blobs.data_ptr(), token.data_ptr(), weight.data_ptr(), x.shape[0],
            x.data_ptr(), gate_up.ctypes.data, down.ctypes.data, biases[0], biases[1],
            _e4m3_table().ctypes.data, ACT_KINDS[act.kind], act.alpha, act.limit, ROWS_PER_TASK,
            get_threads(), out.data_ptr(),
        )  # fmt: skip
    if status != 0:
        raise MemoryError("the C CPU expert kernel could not allocate its scratch memory")
    return out


@functools.cache
def _e4m3_table() -> np.ndarray:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def _matrix_layout(fmt: BlobFormat, name: str) -> np.ndarray:
    """[codes, scales, row_scale, grid] byte offsets and [rows, K, group] of one q2s matrix."""
    codes = fmt.tensor(f"{name}.codes")
    scales = fmt.tensor(f"{name}.scales")
    n, k = codes.shape[0], codes.shape[1] * 4
    group = k // scales.shape[1]
    offsets = [codes.offset, scales.offset, fmt.tensor(f"{name}.row_scale").offset]
    return np.array([*offsets, fmt.tensor(f"{name}.grid").offset, n, k, group], dtype=np.int64)


@functools.cache
def _layout(fmt: BlobFormat) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """Both matrices' layouts and the float32 biases' byte offsets (-1: none)."""
    biases = tuple(
        fmt.tensor(n).offset if has_tensor(fmt, n) else -1 for n in ("gate_up_bias", "down_bias")
    )
    return _matrix_layout(fmt, "gate_up"), _matrix_layout(fmt, "down"), (biases[0], biases[1])
