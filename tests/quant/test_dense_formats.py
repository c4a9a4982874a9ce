"""Dense formats in the store (#52): quantizers against their definitions, the classes of real
tensor names, the converter keeping an FP8 checkpoint's tensors bit for bit, and both model paths
against the HF forward of the dequantised weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import source_checkpoints as sc
import torch
from safetensors.torch import load_file, save_file

from moetier.config import EngineConfig
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.models.dense_linear import DenseLinear
from moetier.quant.convert import convert
from moetier.quant.dense_formats import (
    DenseFormat,
    DensePolicy,
    dense_class,
    quantize_fp8_block,
    quantize_int4,
)
from moetier.quant.fp4 import quantize_nvfp4
from moetier.quant.sources import dequant_fp8_block
from moetier.quant.store import Store

FP32 = dict(device="cpu", dtype="float32")


def prompt(vocab: int, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(7))


def hf_greedy(model, ids: torch.Tensor) -> list[int]:
    out = model.generate(
        ids[:1], max_new_tokens=16, do_sample=False, eos_token_id=0, pad_token_id=0
    )
    tokens = out[0, ids.shape[1] :].tolist()
    return tokens[: tokens.index(0)] if 0 in tokens else tokens  # moetier leaves out the eos


def moetier_greedy(loaded, ids: torch.Tensor) -> list[int]:
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    return Generator(loaded).generate(ids[0].tolist(), greedy).token_ids


def hf_reference(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, experts_implementation="eager"
    ).eval()


def _decode_int4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int4 layout decoded element by element from its definition (docs/formats.md)."""
    n, half = codes.shape
    out = torch.empty(n, 2 * half)
    out[:, 0::2] = (codes & 15).float() - 8
    out[:, 1::2] = (codes >> 4).float() - 8
    return out * scale.float().repeat_interleave(2 * half // scale.shape[1], dim=1)


def test_fp8_tiles_are_deepseeks():
    """With steps=1 (DeepSeek's rule) each 128 x 128 tile (edge tiles partial) is scaled so its
    absmax is 448; DeepSeek's own dequantisation of the result is the weight to E4M3's
    precision."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.rand(200, 1, generator=g) * 3
    q, scale_inv = quantize_fp8_block(w, (128, 128), steps=1)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    back = dequant_fp8_block(q, scale_inv, (128, 128))
    for i, j in ((0, 0), (1, 2), (1, 0)):
        tile = q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
        assert tile.abs().max() == 448
    # E4M3 has 3 mantissa bits: relative error <= 2^-4, plus subnormal spacing near zero
    tol = w.abs() * 2**-4 + scale_inv.max() * 2**-9
    assert ((back - w).abs() <= tol).all()


def test_fp8_scale_search_never_loses_to_absmax():
    """The default for float weights: a scale per row and 128 columns, each the best of 16
    candidates absmax/448 * 2^(j/16) by squared error: per tile never worse than absmax/448,
    every scale one of the candidates, and the codes those of round to nearest at it."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 300, generator=g) * torch.rand(40, 1, generator=g)
    q, scale_inv = quantize_fp8_block(w)
    assert scale_inv.shape == (40, 3)
    q1, s1 = quantize_fp8_block(w, (1, 128), steps=1)
    err = (dequant_fp8_block(q, scale_inv, (1, 128)) - w) ** 2
    err1 = (dequant_fp8_block(q1, s1, (1, 128)) - w) ** 2
    tile_err = [err[:, i * 128 : (i + 1) * 128].sum(1) for i in range(3)]
    tile_err1 = [err1[:, i * 128 : (i + 1) * 128].sum(1) for i in range(3)]
    for ours, plain in zip(tile_err, tile_err1, strict=True):
        assert (ours <= plain).all()
    assert err.sum() < 0.9 * err1.sum()
    ratio = torch.log2(scale_inv / s1) * 16
    assert (ratio - ratio.round()).abs().max() < 1e-3 and ratio.min() > -1e-3 and ratio.max() < 15.5
    full = scale_inv.repeat_interleave(128, 1)[:, :300]
    assert torch.equal(q, (w / full).clamp(-448, 448).to(torch.float8_e4m3fn))


def test_int4_reproduces_a_weight_on_its_grid_and_beats_absmax():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-7, 8, (16, 256), generator=g).float()
    q[:, ::64] = 7  # every group of 64 reaches the top of the grid
    scale = (torch.rand(16, 4, generator=g) + 0.5).bfloat16().float()
    w = q * scale.repeat_interleave(64, dim=1)
    codes, s = quantize_int4(w, 64)
    assert codes.shape == (16, 128) and s.shape == (16, 4) and s.dtype == torch.bfloat16
    assert torch.equal(_decode_int4(codes, s), w)

    w = torch.randn(64, 512, generator=g)
    w[0, 5] = 40.0  # an outlier: clipping pays elsewhere in its group, not for it
    codes, s = quantize_int4(w)
    ours = ((_decode_int4(codes, s) - w) ** 2).view(64, 4, 128).sum(-1)
    plain = (w.view(64, 4, 128).abs().amax(-1, keepdim=True) / 7).bfloat16().float()
    rtn = ((w.view(64, 4, 128) / plain).round().clamp(-8, 7) * plain - w.view(64, 4, 128)) ** 2
    assert (ours <= rtn.sum(-1) * (1 + 1e-6)).all()
    assert ours.sum() < 0.9 * rtn.sum()


def test_formats_round_trip_through_their_definitions():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 96, generator=g)
    fp8 = DenseFormat.parse("fp8")
    parts = fp8.quantize(w)
    assert fp8.block == (1, 128)
    assert torch.equal(fp8.dequantize(parts), dequant_fp8_block(*parts, (1, 128)))
    int4 = DenseFormat.parse("int4-g32")
    parts = int4.quantize(w)
    assert torch.equal(int4.dequantize(parts), _decode_int4(*parts))
    nvfp4 = DenseFormat.parse("nvfp4")
    parts = nvfp4.quantize(w)
    assert torch.equal(nvfp4.dequantize(parts), quantize_nvfp4(w).dequantize())
    assert [tuple(p.shape) for p in parts] == [s for _, _, s in nvfp4.tensors("a.weight", (48, 96))]
    assert int4.bits_per_weight((48, 96)) == 4 + 16 / 32
    assert fp8.bits_per_weight((256, 256)) == 8 + 32 / 128  # a float32 per 128 weights
    assert DenseFormat.parse("fp8-b128x128").bits_per_weight((256, 256)) == 8 + 4 * 32 / 256**2


def test_classes_of_real_names():
    cases = {
        "model.layers.0.self_attn.q_a_proj.weight": "attention",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "attention",
        "model.layers.3.self_attn.o_proj.weight": "attention",
        "model.layers.0.mlp.gate_proj.weight": "mlp",
        "model.layers.5.mlp.shared_experts.down_proj.weight": "shared",
        "model.layers.5.mlp.shared_expert.up_proj.weight": "shared",
        "model.layers.5.mlp.gate.weight": "router",
        "model.layers.5.mlp.shared_expert_gate.weight": "router",
        "model.layers.0.self_attn.q_a_layernorm.weight": "other",
        "model.embed_tokens.weight": "embed",
        "lm_head.weight": "lm_head",
    }
    assert {k: dense_class(k) for k in cases} == cases
    assert dense_class("model.layers.0.self_attn.q_proj.bias", 1) == "other"
    policy = DensePolicy.parse("int4", ["lm_head=fp8", "attention=bf16"])
    assert policy.choose("lm_head.weight", (320, 64)).name == "fp8-b1x128"
    assert policy.choose("model.layers.0.self_attn.q_proj.weight", (64, 64)) is None
    assert policy.choose("model.layers.0.mlp.up_proj.weight", (96, 64)) is None  # K % 128
    assert policy.choose("model.layers.0.mlp.up_proj.weight", (96, 256)).name == "int4-g128"
    assert policy.choose("model.embed_tokens.weight", (320, 256)) is None
    kept = DensePolicy.parse("fp8").choose("x.mlp.down_proj.weight", (8, 8), source_fp8=(8, 8))
    assert kept == DenseFormat("fp8", (8, 8), source=True)
    with pytest.raises(ValueError, match="CLASS=FORMAT"):
        DensePolicy.parse("fp8", ["embed=fp8"])
    with pytest.raises(ValueError, match="int4-gN"):
        DenseFormat.parse("int3")


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny, tmp_path_factory):
    """The tiny DeepSeek-V3 written as DeepSeek-V3's FP8 release (block-scaled decoder Linears,
    weight + weight_scale_inv), with its release tile (128 x 128) and a small one (8 x 8, so
    the tiny matrices hold many tiles)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for block in ((128, 128), (8, 8)):
        path = root / f"b{block[0]}"
        sc.write_fp8_block(tiny.checkpoint("deepseek_v3"), path, block)
        store = root / f"store-b{block[0]}"
        # lm_head stays as the release has it (bf16): only the checkpoint's FP8 is kept
        convert(path, store, progress=False, dense=DensePolicy.parse("fp8", ["lm_head=bf16"]))
        out[block] = (path, store)
    return out


def _hf_dequantised(checkpoint, block):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    qc = FineGrainedFP8Config(dequantize=True, weight_block_size=block)
    return AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=qc, dtype=torch.float32, experts_implementation="eager"
    ).eval()


@pytest.mark.parametrize("block", [(128, 128), (8, 8)])
def test_fp8_checkpoint_kept_bit_for_bit(fp8_checkpoints, block):
    checkpoint, store_path = fp8_checkpoints[block]
    state = load_file(str(checkpoint / "model.safetensors"))
    dense = load_file(str(store_path / "dense.safetensors"))
    store = Store(store_path)
    kept = 0
    for key, value in state.items():
        if value.dtype != torch.float8_e4m3fn or ".experts." in key:
            continue
        assert torch.equal(dense[key].view(torch.uint8), value.view(torch.uint8)), key
        scale = key + "_scale_inv"
        assert torch.equal(dense[scale].view(torch.int32), state[scale].view(torch.int32))
        assert store.dense_formats[key[: -len(".weight")]] == DenseFormat("fp8", block, source=True)
        kept += 1
    # per layer: q_a, q_b, kv_a, kv_b, o; the dense MLP's and shared expert's three
    assert kept == 3 * 5 + 3 * 3
    assert len(store.dense_formats) == kept
    assert dense["lm_head.weight"].dtype == torch.float32  # lm_head=bf16: as the checkpoint
    by_class = store.dense_bytes_by_class()
    assert sum(by_class.values()) == store.dense_size[1]


@pytest.mark.parametrize("block", [(128, 128), (8, 8)])
@pytest.mark.parametrize("native", [True, False], ids=["native", "transformers"])
def test_fp8_store_matches_hf_dequantised_forward(fp8_checkpoints, block, native):
    """Logits within 1e-3 of max |logit| in fp32 and the same greedy tokens as transformers'
    forward of the dequantised checkpoint; the FP8 weights run as DenseLinear."""
    checkpoint, store_path = fp8_checkpoints[block]
    loaded = load_model(store_path, EngineConfig(native=native, **FP32))
    modules = [m for m in loaded.model.modules() if isinstance(m, DenseLinear)]
    assert len(modules) == 3 * 5 + 3 * 3
    ref = _hf_dequantised(checkpoint, block)
    ids = prompt(loaded.model_config.vocab_size)
    with torch.no_grad():
        theirs = ref(ids).logits
        if native:
            cache = loaded.model.new_cache(ids.shape[0], 64, torch.float32, "cpu")
            positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            ours = loaded.model(ids, positions, cache)
        else:
            ours = loaded.model(ids).logits
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"fp8 b{block[0]} {'native' if native else 'transformers'}: rel diff {rel:.2e}")
    assert rel <= 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert moetier_greedy(loaded, ids) == hf_greedy(ref, ids)


@pytest.mark.parametrize("fmt", ["fp8", "int4-g16", "nvfp4"])
def test_quantized_dense_from_float_source_matches_hf(tiny, tmp_path, fmt):
    """A float checkpoint converted with --dense FMT runs, on both paths, as the HF model whose
    dense weights are the stored ones decoded by their definitions."""
    src = tiny.checkpoint("qwen3_moe")
    store_path = convert(src, tmp_path / "store", progress=False, dense=DensePolicy.parse(fmt))
    store = Store(store_path)
    assert {info["class"] for info in store.index["dense"]["tensors"].values()} == {
        "attention",
        "lm_head",
    }
    dense = load_file(str(store_path / "dense.safetensors"))
    state = load_file(str(src / "model.safetensors"))
    for module, f in store.dense_formats.items():
        parts = [dense[name] for name, _, _ in f.tensors(module + ".weight", (1, 2))]
        if f.kind == "fp8":
            w = dequant_fp8_block(parts[0], parts[1], f.block)
        elif f.kind == "int4":
            w = _decode_int4(parts[0], parts[1])
        else:
            w = quantize_nvfp4(state[module + ".weight"]).dequantize()
        assert w.shape == state[module + ".weight"].shape
        state[module + ".weight"] = w
    ref_dir = tmp_path / "reference"
    sc._copy_aux(src, ref_dir)
    save_file(state, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_reference(ref_dir)
    ids = prompt(store.model_config.vocab_size)
    with torch.no_grad():
        theirs = ref(ids).logits
        ours_hf = load_model(store_path, EngineConfig(native=False, **FP32)).model(ids).logits
        native = load_model(store_path, EngineConfig(native=True, **FP32))
        cache = native.model.new_cache(ids.shape[0], 64, torch.float32, "cpu")
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        ours_native = native.model(ids, positions, cache)
    assert (ours_hf - theirs).abs().max().item() <= 1e-4
    assert (ours_native - theirs).abs().max().item() <= 1e-4


def test_weights_int4_cannot_take_are_named(tiny, tmp_path, capfd):
    """`--dense int4` (group 128) on K=64 weights left every one unquantized without a word:
    one line names them, why, and the group that fits (docs/formats.md: such a weight stays
    unquantized)."""
    convert(tiny.checkpoint("qwen3_moe"), tmp_path / "g128", progress=False,
            dense=DensePolicy.parse("int4"))  # fmt: skip
    line = next(x for x in capfd.readouterr().err.splitlines() if "--dense" in x)
    assert line.startswith("moetier convert: --dense int4-g128: 9 weight(s) stay as the ")
    assert "K is not a multiple of 128: lm_head.weight (K 64)" in line
    assert line.endswith("and 6 more; int4-g64 (or a smaller group) would fit them")
    assert Store(tmp_path / "g128").dense_formats == {}  # what the line says
    convert(tiny.checkpoint("qwen3_moe"), tmp_path / "g32", progress=False,
            dense=DensePolicy.parse("int4-g32"))  # fmt: skip
    assert "--dense" not in capfd.readouterr().err
    assert len(Store(tmp_path / "g32").dense_formats) == 9
    shapes = {"model.layers.0.self_attn.o_proj.weight": (64, 24), "x.mlp.up_proj.weight": (8, 9)}
    assert DensePolicy.parse("nvfp4").unfit(shapes) == (
        "nvfp4: 2 weight(s) stay as the checkpoint has them, their K is not a multiple of 16: "
        "model.layers.0.self_attn.o_proj.weight (K 24), x.mlp.up_proj.weight (K 9)"
    )
    odd = DensePolicy.parse("int4-g16").unfit(shapes)
    assert odd is not None and odd.endswith("; no int4 group fits an odd K")
    assert DensePolicy.parse("bf16").unfit(shapes) is None


def test_convert_cli_prints_bytes_per_class(tiny, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "moetier", "convert", str(tiny.checkpoint("qwen3_moe")),
         str(tmp_path / "s"), "--dense", "int4-g32", "--dense-override", "lm_head=fp8"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if x.strip().startswith("dense "))
    store = Store(tmp_path / "s")
    by_class = store.dense_bytes_by_class()
    assert "attention" in line and "(int4-g32)" in line and "(fp8-b1x128)" in line
    assert f"embed {by_class['embed'] / 2**20:,.2f} MiB" in line


def test_synthetic_store_and_bench_with_dense_fp8(tmp_path, capsys):
    """`moetier bench --shape tiny --dense fp8`: the synthetic store holds fp8 attention and
    lm_head, the engine decodes it, and the floor's dense bytes are the stored ones."""
    import json

    from moetier.cli.main import main
    from moetier.quant.synthetic import shape, write_synthetic_store

    path = write_synthetic_store(tmp_path / "s", shape("tiny", 1), dense=DensePolicy.parse("fp8"))
    store = Store(path)
    assert {info["class"] for info in store.index["dense"]["tensors"].values()} == {
        "attention",
        "lm_head",
    }
    loaded = load_model(path, EngineConfig(**FP32))
    assert sum(isinstance(m, DenseLinear) for m in loaded.model.modules()) == 5
    args = ["bench", "--device", "cpu", "--json", "--shape", "tiny", "--layers", "1"]
    args += ["--prompt-tokens", "8", "--new-tokens", "3", "--dense", "fp8"]
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["dense_formats"] == ["fp8-b1x128"]
    assert line["decode_tok_s"] > 0 and line["decode_tokens"] == 2


def test_planner_counts_quantized_dense_bytes(fp8_checkpoints):
    """The planner's dense part: the FP8 weights and their scales as stored, every other
    floating tensor at the run dtype (bf16: 2 bytes)."""
    from safetensors import safe_open

    from moetier.residency.planner import plan

    store = Store(fp8_checkpoints[(8, 8)][1])
    expected = 0
    with safe_open(str(store.path / "dense.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            numel = torch.Size(t.get_shape()).numel()
            if t.get_dtype() in ("F8_E4M3",) or key.endswith("_scale_inv"):
                expected += numel * (1 if t.get_dtype() == "F8_E4M3" else 4)
            else:
                expected += numel * 2
    assert plan(store, 2**34).dense_bytes == expected
    assert expected < store.dense_size[0] * 2


@pytest.mark.parametrize("name", ["fp8-b32", "int4-g32", "nvfp4"])
def test_fused_qkv_equals_the_three_projections(name):
    """fuse_dense_qkv: one DenseLinear over q, k and v whose output is theirs side by side,
    the parts left as views of it; refused where the formats say the rows cannot join."""
    from moetier.models.dense_linear import fuse_dense_qkv

    fmt = DenseFormat("fp8", (32, 32)) if name == "fp8-b32" else DenseFormat.parse(name)
    g = torch.Generator().manual_seed(5)
    parts = []
    for rows in (64, 32, 32):
        linear = DenseLinear(64, rows, fmt)
        stored = fmt.quantize(torch.randn(rows, 64, generator=g))
        for (leaf, _, _), value in zip(fmt.tensors("weight", (rows, 64)), stored, strict=True):
            setattr(linear, leaf, torch.nn.Parameter(value, requires_grad=False))
        parts.append(linear)
    x = torch.randn(3, 64, generator=g)
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse_dense_qkv(parts)
    if name == "nvfp4":  # each part has its own tensor scale: kept apart
        assert fused is None
        return
    assert fused is not None and torch.equal(fused(x), separate)
    assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), separate)
    assert parts[1].weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    if name == "fp8-b32":  # a tile of 32 rows would straddle a 48-row q and k: refused
        odd = [DenseLinear(64, 48, fmt), DenseLinear(64, 16, fmt)]
        assert fuse_dense_qkv(odd) is None


def test_native_attention_runs_fused_int4(tiny, tmp_path):
    from moetier.models.layers import Attention

    path = convert(
        tiny.checkpoint("qwen3_moe"), tmp_path / "s", progress=False,
        dense=DensePolicy.parse("int4-g16"),
    )  # fmt: skip
    loaded = load_model(path, EngineConfig(native=True, **FP32))
    attention = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    assert attention and all(isinstance(m.qkv_proj, DenseLinear) for m in attention)
    assert sum(isinstance(m, DenseLinear) for m in loaded.model.modules()) == 4 * len(attention) + 1
