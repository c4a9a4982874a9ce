"""The CPU q2s expert kernel (moetier/kernels/cpu) against its torch twin, and the twin against
the project's reference MoE kernel (moe_ref.moe_slots_ref), over awkward shapes: one pair, many
tokens on one expert, tails past the vector width, groups of every kind the kernel handles
(16, 32, 48: a word's group gathered, 64, a whole row), fitted and evenly spaced grids, raw
E4M3 scale bytes (subnormals, negative), biases and the three activations, bf16 and fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetier.config import ExpertActivation
from moetier.core.layout import (
    TENSOR_ALIGN,
    align_up,
    fp4_expert_format,
    q2s_expert_format,
    raw_expert_format,
)
from moetier.kernels.cpu.build import load, vector_path
from moetier.kernels.cpu.dram import dram_read_bandwidth, get_threads, set_threads
from moetier.kernels.cpu.experts import (
    choose_backend,
    cpu_experts,
    cpu_experts_ref,
    cpu_supports,
)
from moetier.kernels.moe_ref import moe_slots_ref
from moetier.quant.synthetic import random_blob

pytestmark = pytest.mark.skipif(load() is None, reason="no C compiler to build the CPU kernel")


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


# every vector path this CPU can run: native (AVX-512 VNNI here where present), AVX2, plain C
MARCHES = ["native"] + (["haswell"] if {"avx2", "fma", "bmi2"} <= _cpu_flags() else []) + ["x86-64"]


def _pool(fmt, experts: int, seed: int, raw_scales: bool = True):
    """`experts` random blobs of `fmt` in one aligned host buffer -> (buffer, blob addresses).
    Odd blobs have fitted grids (b != 3a); raw_scales: every scale byte drawn from 0..0x7E and
    0x80..0xFE (E4M3 subnormals and negative scales included, no NaN)."""
    generator = torch.Generator().manual_seed(seed)
    row = align_up(fmt.nbytes, TENSOR_ALIGN)
    buf = torch.zeros(experts * row + TENSOR_ALIGN, dtype=torch.uint8)
    first = (-buf.data_ptr()) % TENSOR_ALIGN
    for e in range(experts):
        blob = buf[first + e * row : first + e * row + fmt.nbytes]
        random_blob(fmt, generator, blob, fitted_grid=e % 2 == 1)
        for spec in fmt.tensors:
            if raw_scales and spec.name.endswith(".scales"):
                values = torch.randint(0, 127, (spec.nbytes,), generator=generator)
                values |= torch.randint(0, 2, (spec.nbytes,), generator=generator) * 128
                blob[spec.offset : spec.offset + spec.nbytes] = values.to(torch.uint8)
            if spec.name == "gate_up.grid":  # evenly spaced as the kernel tests it (float32)
                a, b = blob[spec.offset : spec.offset + 8].view(torch.float32)
                assert bool(b - 3 * a == 0) == (e % 2 == 0)
    addresses = torch.tensor([buf.data_ptr() + first + e * row for e in range(experts)])
    return buf, addresses


SHAPES = [  # hidden, intermediate, gate_up group, down group
    (2048, 768, 32, 16),  # Qwen3-30B-A3B's expert, the default q2s groups
    (48, 80, 16, 16),  # every row shorter than one vector
    (320, 272, 64, 16),  # a vector chunk, then a tail
    (480, 144, 48, 48),  # groups of 3 words: the gathered group scales
    (512, 96, 512, 32),  # one group per gate_up row
    (1024, 128, 128, 64),  # groups of 64 and more, each scale reused over several steps
    (1536, 256, 256, 128),
]
CASES = [  # name, tokens, expert of each (token, k) pair
    ("one pair", 1, [[3]]),
    ("many tokens on one expert", 9, [[2]] * 9),
    ("mixed", 5, [[0, 1], [1, 4], [0, 2], [3, 3], [5, 1]]),
]


@pytest.mark.parametrize(
    "march,shape",
    [(m, s) for s in SHAPES for m in MARCHES if m == "native" or s[0] < 2048],  # (time)
    ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)),
)
def test_c_kernel_matches_twin(march, shape):
    hidden, inter, group, down_group = shape
    fmt = q2s_expert_format(hidden, inter, False, group, down_group)
    assert cpu_supports(fmt, "c", march)
    buf, addresses = _pool(fmt, 6, seed=sum(shape))
    act = ExpertActivation()
    for name, tokens, ids in CASES:
        generator = torch.Generator().manual_seed(tokens)
        ids_t = torch.tensor(ids)
        k = ids_t.shape[1]
        token = torch.arange(tokens).repeat_interleave(k)
        weight = torch.rand(tokens * k, generator=generator)
        x = torch.randn(tokens, hidden, generator=generator) * 3
        got = cpu_experts(x, token, weight, addresses[ids_t.flatten()], fmt, act, "c", march)
        want = cpu_experts_ref(x, token, weight, addresses[ids_t.flatten()], fmt, act, True)
        err = ((got - want).abs().max() / want.abs().max()).item()
        # both round the activation to int8 words between the matrices: where the twin's
        # float32 GEMM (the machine's BLAS, its own summation order) lands an ulp away, a word
        # rounds the other way (4.8e-5 in the many-token case on an AMD EPYC host, under 2e-5
        # on others); a wrong decode or accumulation is off by 1e-2 and more
        assert err < 1e-4, f"{name}: relative error {err:.2e} ({march}, {vector_path(march)})"


@pytest.mark.parametrize("activation", ["silu_clamped", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_biases_activations_and_dtypes(activation, dtype):
    fmt = q2s_expert_format(256, 128, True, 32, 16, bias_dtype="float32")
    buf, addresses = _pool(fmt, 3, seed=5)
    act = ExpertActivation(kind=activation, alpha=1.702, limit=2.0)  # a limit that clamps
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 256, generator=generator) * 4).to(dtype)
    token = torch.tensor([0, 1, 1, 2, 3, 3])
    weight = torch.rand(6, generator=generator).to(dtype)
    blobs = addresses[torch.tensor([0, 2, 1, 2, 0, 1])]
    got = cpu_experts(x, token, weight, blobs, fmt, act, "c")
    want = cpu_experts_ref(x, token, weight, blobs, fmt, act, act_int8=True)
    assert got.dtype == torch.float32
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-5


@pytest.mark.parametrize("act_int8", [False, True])
def test_twin_matches_moe_reference(act_int8):
    """The twin against moe_slots_ref reading the same blobs through a slot table: each pair's
    row, also the bf16-free float32 path of the reference (act_int8 rounds both inputs alike)."""
    fmt = q2s_expert_format(128, 64, False, 32, 16)
    buf, addresses = _pool(fmt, 4, seed=9, raw_scales=False)
    row = int(addresses[1] - addresses[0])
    first = int(addresses[0]) - buf.data_ptr()
    pool = buf[first : first + 4 * row].view(4, row)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 128, generator=generator)
    ids = torch.tensor([[0, 3], [2, 0], [1, 1]])
    weights = torch.rand(3, 2, generator=generator)
    act = ExpertActivation()
    out = torch.zeros(3, 2, 128)
    moe_slots_ref(x, ids, weights, torch.arange(4, dtype=torch.int32), pool, fmt, act, out,
                  act_int8=act_int8)  # fmt: skip
    token = torch.arange(3).repeat_interleave(2)
    twin = cpu_experts_ref(x, token, weights.flatten(), addresses[ids.flatten()], fmt, act,
                           act_int8)  # fmt: skip
    torch.testing.assert_close(twin, out.reshape(6, 128), rtol=1e-5, atol=1e-5)


def test_other_formats_take_the_twin():
    for fmt in (
        raw_expert_format("bfloat16", 64, 32, False),
        fp4_expert_format("nvfp4", 64, 32, False),
        q2s_expert_format(72, 32, False, 8, 8),  # groups of 8: not a multiple of a word
    ):
        assert not cpu_supports(fmt, "c")
        assert choose_backend(fmt) == "torch"
        with pytest.raises(ValueError, match="does not run"):
            cpu_experts(torch.zeros(1, 64), torch.zeros(1, dtype=torch.long), torch.ones(1),
                        torch.zeros(1, dtype=torch.long), fmt, ExpertActivation(), "c")  # fmt: skip
    fmt = raw_expert_format("bfloat16", 64, 32, False)
    buf, addresses = _pool(fmt, 2, seed=3, raw_scales=False)
    x = torch.randn(2, 64)
    token, weight = torch.tensor([0, 1]), torch.tensor([0.5, 2.0])
    got = cpu_experts(x, token, weight, addresses, fmt, ExpertActivation())  # auto: the twin
    first = int(addresses[0]) - buf.data_ptr()
    row = int(addresses[1] - addresses[0])
    pool = buf[first : first + 2 * row].view(2, row)
    out = torch.zeros(2, 1, 64)
    moe_slots_ref(x, torch.tensor([[0], [1]]), weight[:, None], torch.arange(2, dtype=torch.int32),
                  pool, fmt, ExpertActivation(), out)  # fmt: skip
    torch.testing.assert_close(got, out[:, 0], rtol=1e-5, atol=1e-6)


def test_threads_and_dram_read():
    lib = load()
    words = torch.randint(-(2**40), 2**40, (100_003,), dtype=torch.int64)
    for threads in (1, 2):
        assert lib.mt_read_sum(words.data_ptr(), words.numel(), threads) == int(words.sum())
    assert dram_read_bandwidth(2**22, reps=1, backend="c") > 0
    # the kernel names its team's size, whichever thread calls it (OpenMP's default count is
    # per calling thread, and torch sets it in the threads it runs ops on)
    from concurrent.futures import ThreadPoolExecutor

    fmt = q2s_expert_format(64, 32, False, 32, 16)
    buf, addresses = _pool(fmt, 1, seed=4)
    one = torch.zeros(1, dtype=torch.long)

    def team() -> int:
        cpu_experts(torch.randn(1, 64), one, torch.ones(1), addresses, fmt, ExpertActivation())
        return int(lib.mt_last_team())

    for threads in (1, 2):
        assert set_threads(threads) == threads == get_threads()
        assert team() == threads
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(team).result() == threads
    set_threads(0)
