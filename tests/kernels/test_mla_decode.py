"""The MLA decode kernel (`moetier::mla_decode`) against its twin (pages gathered, one SDPA call
with the heads as query rows) and both against the rows laid out by a plain loop: awkward head
counts and widths, cache rows wider than latent + rope (glm_moe_dsa's), forced and chosen
splits, pages shuffled through the pool, NaN past each position and in pages of no row; fp32
under Triton's interpreter on CPU (its 16-bit `tl.dot` is wrong), 16-bit and CUDA graphs on the
GPU. Then MLAttention decoding through it against its SDPA path and against attention with the
keys and values expanded per head (transformers' order of operations), a tiny native
deepseek_v3 decoding through it, and the paged engine's decode rows through it (no gathered
keys) token-identical to each request alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.engine.static_decode import StaticDecoder
from moetier.kernels.mla_decode import (
    SPLIT_THRESHOLD,
    choose_config,
    mla_decode,
    mla_decode_ref,
)
from moetier.loader.load import load_model
from moetier.models import layers
from moetier.models.attention_batch import AttentionBatch

pytest.importorskip("triton")
from moetier.kernels.mla_decode import mla_decode_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_inputs(batch, heads, lora, rope, extra, page_size, lengths, seed=0, spare=3):
    """Rows of `lengths` positions in shuffled pages of a pool [P, page_size, lora + rope +
    extra] with `spare` pages of no row; every entry past a row's last position is NaN (a kernel
    reading it would turn NaN). -> q [B, H, lora + rope], pages, table [B, T] int32, positions,
    and the rows laid out contiguously [B, T * page_size, width] by a plain loop, NaN zeroed."""
    gen = torch.Generator().manual_seed(seed + heads + lora + page_size)
    width = max(-(-n // page_size) for n in lengths)
    count = batch * width + spare
    order = torch.randperm(count, generator=gen)
    dim = lora + rope + extra
    pages = torch.full((count, page_size, dim), float("nan"))
    table = torch.zeros(batch, width, dtype=torch.int32)
    flat = torch.zeros(batch, width * page_size, dim)
    for b, n in enumerate(lengths):
        for w in range(-(-n // page_size)):
            page = int(order[b * width + w])
            table[b, w] = page
            entries = torch.randn(page_size, dim, generator=gen)
            entries[max(0, n - w * page_size) :] = float("nan")  # past the last position
            pages[page] = entries
            flat[b, w * page_size : (w + 1) * page_size] = entries.nan_to_num()
    q = torch.randn(batch, heads, lora + rope, generator=gen)
    positions = torch.tensor([n - 1 for n in lengths])
    return [t.to(DEVICE) for t in (q, pages, table, positions, flat)]


# (batch, heads, lora, rope, extra columns, page_size, lengths, splits); splits None: chosen
CASES = [
    (2, 4, 16, 8, 0, 4, [5, 13], None),  # the tiny deepseek_v3's shape
    (3, 20, 64, 16, 0, 16, [1, 40, 77], None),  # heads beyond one block, not a multiple of it
    (2, 8, 32, 16, 24, 8, [9, 31], 3),  # rows wider than latent + rope (glm_moe_dsa's), split
    (1, 4, 16, 8, 0, 4, [6], 8),  # more splits than position blocks: empty splits
    (2, 16, 32, 16, 0, 32, [SPLIT_THRESHOLD + 44, 17], None),  # split path, chosen
    (1, 16, 512, 64, 0, 64, [100], 2),  # DeepSeek-V3's latent and rope widths
]


def check_case(case, dtype, atol, rtol):
    batch, heads, lora, rope, extra, page_size, lengths, splits = case
    q, pages, table, pos, flat = paged_inputs(batch, heads, lora, rope, extra, page_size, lengths)
    q, pages, flat = q.to(dtype), pages.to(dtype), flat.to(dtype)
    scale = (lora + rope) ** -0.5 * 1.3  # some yarn mscale
    got = mla_decode_triton(q, pages, table, pos, lora, scale, splits=splits)
    want = mla_decode_ref(q, flat, None, pos, lora, scale)
    assert got.dtype == dtype and got.shape == (batch, heads, lora) and got.is_contiguous()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return q, pages.nan_to_num(), table, pos, scale, want


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_rows_laid_out(case):
    q, clean, table, pos, scale, want = check_case(case, torch.float32, atol=2e-5, rtol=1e-5)
    lora = case[2]
    via_twin = mla_decode_ref(q, clean, table, pos, lora, scale)  # the twin's own gather
    torch.testing.assert_close(via_twin, want, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    CASES
    + [
        (1, 128, 512, 64, 0, 16, [300], None),  # DeepSeek-V3's heads, one pass
        (1, 128, 512, 64, 0, 64, [4096], None),  # split path, chosen
        (8, 64, 512, 64, 0, 16, [5, 2048, 1000, 1, 64, 63, 1500, 700], None),  # Kimi K2 / GLM-5
        (4, 64, 512, 64, 128, 64, [3000, 17, 129, 64], None),  # glm_moe_dsa's row width
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_the_rows_laid_out_16bit_gpu(case, dtype):
    check_case(case, dtype, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [1, 3])
def test_static_cache_without_a_page_table(splits):
    """No page table: row b reads page b (the static cache [B, L, W]), equal to the same cache
    through the identity table, and to the twin."""
    q, _, _, pos, flat = paged_inputs(3, 8, 32, 16, 8, 16, [70, 1, 33])
    identity = torch.arange(3, dtype=torch.int32, device=DEVICE)[:, None]
    got = mla_decode_triton(q, flat, None, pos, 32, 0.2, splits=splits)
    via_table = mla_decode_triton(q, flat, identity, pos, 32, 0.2, splits=splits)
    torch.testing.assert_close(got, via_table, atol=0, rtol=0)
    want = mla_decode_ref(q, flat, None, pos, 32, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(mla_decode(q, flat, None, pos, 32, 0.2), want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one row per query row"):
        mla_decode(q[:2], flat, None, pos[:2], 32, 0.2)


def test_choose_config_splits_from_shapes():
    fp32, bf16 = torch.float32, torch.bfloat16
    assert choose_config(1, 128, SPLIT_THRESHOLD, bf16).splits == 1  # short caches: one pass
    assert choose_config(1, 128, 163840, bf16).splits == 33  # 8 head blocks: 264 programs
    assert choose_config(1, 64, 4096, bf16).splits == 32  # 4096 / 128 positions a split
    assert choose_config(64, 128, 163840, bf16).splits == 1  # 512 programs without splitting
    assert choose_config(2, 16, 300, fp32).splits == 3  # 300 positions: 3 of >= 128
    assert choose_config(1, 16, 1000, fp32, split_threshold=2000).splits == 1
    assert choose_config(1, 128, 4096, bf16).block_l == 32
    assert choose_config(1, 128, 4096, fp32).block_l == 16


def test_op_and_opcheck():
    """The op (on CPU the interpreter runs the kernel: conftest sets TRITON_INTERPRET), its
    schema and fake against the real one."""
    q, pages, table, pos, flat = paged_inputs(2, 4, 16, 8, 0, 4, [7, 3])
    clean = pages.nan_to_num()
    got = mla_decode(q, clean, table, pos, 16, 0.3)
    torch.testing.assert_close(
        got, mla_decode_ref(q, flat, None, pos, 16, 0.3), atol=2e-5, rtol=1e-5
    )
    torch.library.opcheck(mla_decode, (q, clean, table, pos, 16, 0.3))


def test_refuses_bad_operands():
    q, pages, table, pos, _ = paged_inputs(2, 4, 16, 8, 0, 4, [7, 3])
    pages = pages.nan_to_num()
    with pytest.raises(ValueError, match=r"q must be \[B, H"):
        mla_decode(q[:, :, None], pages, table, pos, 16, 0.3)
    with pytest.raises(ValueError, match="kv_lora_rank = 24"):
        mla_decode(q, pages, table, pos, 24, 0.3)
    with pytest.raises(ValueError, match="no more than the cache's width"):
        mla_decode(torch.cat((q, q), dim=-1), pages, table, pos, 16, 0.3)
    with pytest.raises(ValueError, match="page_table must be"):
        mla_decode(q, pages, table.long(), pos, 16, 0.3)
    with pytest.raises(ValueError, match="positions must be"):
        mla_decode(q, pages, table, pos[:1], 16, 0.3)
    with pytest.raises(ValueError, match="differ in dtype"):
        mla_decode(q.to(torch.bfloat16), pages, table, pos, 16, 0.3)
    if os.environ.get("TRITON_INTERPRET") == "1":
        half = (q.to(torch.bfloat16), pages.to(torch.bfloat16))
        with pytest.raises(ValueError, match="interpreter computes 16-bit"):
            mla_decode_triton(*half, table, pos, 16, 0.3)
        torch.testing.assert_close(  # the op takes the twin instead
            mla_decode(*half, table, pos, 16, 0.3), mla_decode_ref(*half, table, pos, 16, 0.3)
        )


def mla_module(heads=20, lora=32, nope=8, rope=16, v_dim=24, hidden=48, seed=2):
    torch.manual_seed(seed)
    module = layers.MLAttention(0, hidden, heads, 40, lora, nope, rope, v_dim, 0.37, False)
    for p in module.parameters():
        p.data.normal_(0, 0.2)
    return module.to(DEVICE).eval()


def expanded_attention(module, x, cos, sin, keys_cache, positions):
    """MLA as transformers computes it, keys and values expanded per head from the cached latent
    (kv_b_proj applied to every position), one decode token per row: -> [B, 1, hidden]."""
    lora, nope, rope, v_dim = module.dims
    rows, heads = x.shape[0], module.num_heads
    q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
    q = q.view(rows, 1, heads, nope + rope).transpose(1, 2)  # [B, h, 1, qk]
    q_nope, q_rot = q.split([nope, rope], dim=-1)
    q_rot = layers.apply_rotary(q_rot, cos, sin)
    latent, k_rot = keys_cache[..., :lora], keys_cache[..., lora : lora + rope]  # [B, L, *]
    kv = module.kv_b_proj(latent).view(rows, -1, heads, nope + v_dim).transpose(1, 2)
    k_nope, values = kv.split([nope, v_dim], dim=-1)  # [B, h, L, nope], [B, h, L, v]
    keys = torch.cat((k_nope, k_rot[:, None].expand(-1, heads, -1, -1)), dim=-1)
    scores = torch.cat((q_nope, q_rot), dim=-1) @ keys.transpose(-1, -2) * module.scale
    visible = torch.arange(keys.shape[2], device=x.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = scores.softmax(-1) @ values  # [B, h, 1, v]
    return module.o_proj(out.transpose(1, 2).reshape(rows, 1, -1))


@torch.inference_mode()
def test_mla_attention_decodes_through_the_kernel():
    """MLAttention's decode rows over a paged cache: without gathered keys (the engine's CUDA
    batch) it attends through moetier::mla_decode (the interpreter on CPU); equal to its SDPA
    path over gathered keys and to attention with keys and values expanded per head."""
    module = mla_module()
    lora, _, rope, _ = module.dims
    page_size, lengths = 8, [1, 29, 17]
    _, pages, table, pos, _ = paged_inputs(3, 4, lora, rope, 0, page_size, lengths, seed=9)
    cache = pages.nan_to_num()[None]  # [layers = 1, P, PS, lora + rope]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 1, 48, generator=gen).to(DEVICE)
    rotary = layers.RotaryEmbedding(1.0 / (100.0 ** (torch.arange(0, rope, 2) / rope)))
    cos, sin = rotary.to(DEVICE)(pos[:, None], torch.float32)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "mla_decode", lambda *a: calls.append(a) or mla_decode(*a))
        with_kernel = cache.clone()
        batch = AttentionBatch.decode(pos[:, None], table, page_size, with_keys=False)
        got = module(x, cos, sin, batch.head_folded(module.num_heads), with_kernel)
        assert len(calls) == 1  # the kernel attended
        with_sdpa = cache.clone()
        batch = AttentionBatch.decode(pos[:, None], table, page_size, with_keys=True)
        sdpa = module(x, cos, sin, batch.head_folded(module.num_heads), with_sdpa)
        assert len(calls) == (2 if DEVICE == "cuda" else 1)  # CPU: SDPA over gathered keys
    torch.testing.assert_close(with_kernel, with_sdpa)  # the same entries written
    torch.testing.assert_close(got, sdpa, atol=1e-5, rtol=1e-5)
    gathered = with_kernel[0][table.long()].flatten(1, 2)  # [B, T * PS, lora + rope]
    want = expanded_attention(module, x, cos, sin, gathered, pos)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def decode_steps(loaded, prompts, feed, device):
    """Logits of a right-padded prefill then one decode step per column of feed [B, S]."""
    decoder = StaticDecoder(loaded.model, len(prompts), 48, loaded.dtype, device)
    logits = [decoder.prefill(prompts)]
    logits += [decoder.step(feed[:, s]) for s in range(feed.shape[1])]
    return torch.stack(logits)  # [S + 1, B, V]


def test_native_deepseek_v3_decodes_through_the_kernel(tiny, monkeypatch):
    """The tiny native deepseek_v3 decodes rows at different positions of its static cache
    through the kernel (routed there on CPU by patching the CUDA-only condition): the logits of
    every step equal those of the SDPA path, the CPU path users take."""
    loaded = load_model(
        tiny.store("deepseek_v3"), EngineConfig(device="cpu", dtype="float32", native=True)
    )
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, loaded.model_config.vocab_size, (2, 12), generator=gen)
    prompts, feed = [ids[0, :3].tolist(), ids[1, :8].tolist()], ids[:, 8:]
    sdpa = decode_steps(loaded, prompts, feed, "cpu")
    calls = []

    def counted(*args):
        calls.append(args[3].clone())  # positions
        return mla_decode(*args)

    monkeypatch.setattr(layers, "MLA_DECODE_KERNEL", True)
    monkeypatch.setattr(layers, "_decode_kernel_applies", lambda x, tokens: tokens == 1)
    monkeypatch.setattr(layers, "mla_decode", counted)
    kernel = decode_steps(loaded, prompts, feed, "cpu")
    assert len(calls) == feed.shape[1] * loaded.model_config.num_layers
    assert calls[0].tolist() == [3, 8] and calls[-1].tolist() == [6, 11]
    assert (kernel - sdpa).abs().max().item() <= 1e-5


def test_engine_decode_rows_read_pages_in_the_kernel(tiny, monkeypatch):
    """The paged engine on the tiny deepseek_v3 with its decode batches built without gathered
    keys (as on CUDA, where its steps are graphed): every decode row attends through the kernel
    and the greedy tokens equal each request generated alone (static cache, SDPA)."""
    loaded = load_model(
        tiny.store("deepseek_v3"), EngineConfig(device="cpu", dtype="float32", native=True)
    )
    engine = Engine(loaded, EngineLimits(num_pages=32, page_size=4, max_num_batched_tokens=16))
    engine.runner.gather_decode_keys = False
    calls = []
    monkeypatch.setattr(layers, "mla_decode", lambda *a: calls.append(a[2]) or mla_decode(*a))
    vocab = loaded.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    requests = {
        f"r{i}": (torch.randint(3, vocab, (n,), generator=gen).tolist(), new)
        for i, (n, new) in enumerate([(3, 7), (9, 5), (1, 8), (6, 6)])
    }
    for rid, (prompt, new) in requests.items():
        engine.add(rid, prompt, SamplingParams(temperature=0, max_new_tokens=new))
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert calls and all(table is not None for table in calls)  # decode rows, paged
    assert max(len(table) for table in calls) == len(requests)  # batched
    for rid, (prompt, new) in requests.items():
        done = Generator(loaded).generate(prompt, SamplingParams(temperature=0, max_new_tokens=new))
        assert got[rid] == done.token_ids, rid
    assert engine.pool.used_pages == 0


SM90_COMPILE = """
import json
import sys
import torch
sys.path.insert(0, "bench/studies")
from sass_count import compile_sm90
from moetier.kernels import mla_decode

loose = {"sqb", "sqh", "scp", "scl", "spt", "page_size", "sp", "L", "H", "C", "R", "chunk",
         "positions", "page_table"}
for dtype, name, precision in ((torch.bfloat16, "bf16", "tf32"), (torch.float32, "fp32", "ieee")):
    config = mla_decode.choose_config(1, 128, 4096, dtype)
    pointers = {"q": "*" + name, "cache": "*" + name, "out": "*" + name, "positions": "*i64",
                "page_table": "*i32", "part_o": "*fp32", "part_lse": "*fp32",
                "scale_log2": "fp32"}
    for splits, paged in ((1, True), (32, True), (1, False)):
        const = dict(sp=1, spt=1, BLOCK_H=config.block_h, BLOCK_L=config.block_l, BLOCK_C=512,
                     BLOCK_R=64, PRECISION=precision, SPLITS=splits, PAGED=paged)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        _, sass, regs, stack = compile_sm90(
            mla_decode._mla_decode_kernel, const, pointers, loose, options
        )
        print(json.dumps({"dtype": name, "splits": splits, "paged": paged, "registers": regs,
                          "stack": stack, "mma": "HMMA" in sass or "HGMMA" in sass}))
"""


def test_compiles_for_sm90_without_spills():
    """The kernel compiles for the H200 (sm_90) without a GPU (Triton's bundled ptxas) at
    DeepSeek-V3's widths (latent 512, rope 64) with choose_config's tiles, in each constexpr
    path: no stack (spills), 16-bit dots on tensor cores. A construct only the interpreter
    accepts fails here rather than on the GPU. In a subprocess: this process's Triton was
    imported in interpreter mode (conftest)."""
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run(
        [sys.executable, "-c", SM90_COMPILE],
        env=env, cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 6
    assert all(r["stack"] == 0 and r["registers"] <= 255 for r in records), records
    assert all(r["mma"] for r in records if r["dtype"] == "bf16"), records


@pytest.mark.gpu
def test_cuda_graph_replay():
    """Captured once (split path and not), replays for new positions and cache contents."""
    for lengths in ([9, 100], [2000, 3]):
        q, pages, table, pos, _ = paged_inputs(2, 128, 512, 64, 0, 64, lengths)
        q, pages = q.to(torch.bfloat16), pages.nan_to_num().to(torch.bfloat16)
        mla_decode(q, pages, table, pos, 512, 0.1)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mla_decode(q, pages, table, pos, 512, 0.1)
        for step in range(3):
            q.copy_(torch.randn_like(q))
            pages[:, step].normal_()
            pos.copy_(torch.tensor([lengths[0] - 1 - step, step], device="cuda"))
            graph.replay()
            want = mla_decode_ref(q, pages, table, pos, 512, 0.1)
            torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_native_cuda_decode_matches_prefill(tiny):
    """On CUDA deepseek_v3's decode steps run the kernel; in fp32 their logits match a prefill
    of the whole sequence (SDPA)."""
    config = EngineConfig(device="cuda", dtype="float32", native=True)
    loaded = load_model(tiny.store("deepseek_v3"), config)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, loaded.model_config.vocab_size, (1, 12), generator=gen).cuda()
    steps = decode_steps(loaded, [ids[0, :5].tolist()], ids[:, 5:11], "cuda")[:, 0]  # [7, V]
    cache = loaded.model.new_cache(1, 48, loaded.dtype, "cuda")
    with torch.inference_mode():
        full = loaded.model(ids[:, :11], torch.arange(11, device="cuda")[None], cache)[0]
    assert (steps - full[4:11]).abs().max().item() <= 1e-4


def test_sdpa_reference_is_the_softmax_formula():
    """The twin itself against the softmax written out (scores, mask, exp, weighted latents)."""
    q, pages, table, pos, flat = paged_inputs(2, 4, 16, 8, 4, 4, [7, 3])
    scores = torch.einsum("bhd,bld->bhl", q, flat[..., :24]) * 0.3
    visible = torch.arange(flat.shape[1], device=DEVICE)[None, :] <= pos[:, None]
    weights = F.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    want = torch.einsum("bhl,bld->bhd", weights, flat[..., :16])
    torch.testing.assert_close(mla_decode_ref(q, flat, None, pos, 16, 0.3), want)
