"""q2s experts in a store: what the converter writes is what the runtime decodes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny_models import TEXT

from moetier.config import EngineConfig
from moetier.core.layout import MatrixCodec, coded_expert_format
from moetier.kernels.moe_ref import expert_matrix
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.quant.q2s import quantize_q2s
from moetier.quant.store import Store


def test_store_decodes_to_the_quantiser_output(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny.checkpoint("qwen3_moe")
    store = Store(convert_quantized(src, tmp_path / "q2s", group=32, down_group=16, progress=False))
    assert store.index["quantization"] == {
        "experts": "q2s",
        "group": 32,
        "down_group": 16,
        "rounding": "nearest",
    }
    ref = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, experts_implementation="eager"
    )
    experts = ref.get_submodule(store.moe_modules[1])
    fmt = store.blob_format(1)
    for e in (0, 7):
        blob = store.blob(1, e)
        want_gu = quantize_q2s(experts.gate_up_proj[e].detach(), None, group=32).dequantize()
        want_down = quantize_q2s(experts.down_proj[e].detach(), None, group=16).dequantize()
        assert torch.equal(expert_matrix(blob, fmt, "gate_up"), want_gu)
        assert torch.equal(expert_matrix(blob, fmt, "down"), want_down)

    # The whole model equals transformers running the same dequantised experts ("fake quant").
    with torch.no_grad():
        for path in store.moe_modules.values():
            mod = ref.get_submodule(path)
            for e in range(mod.gate_up_proj.shape[0]):
                mod.gate_up_proj[e] = quantize_q2s(mod.gate_up_proj[e], None, group=32).dequantize()
                mod.down_proj[e] = quantize_q2s(mod.down_proj[e], None, group=16).dequantize()
        loaded = load_model(store.path, EngineConfig(native=False, device="cpu", dtype="float32"))
        ids = torch.randint(1, 320, (2, 12), generator=torch.Generator().manual_seed(0))
        assert (loaded.model(ids).logits - ref(ids).logits).abs().max() < 1e-4


def test_calibrated_rounding_fits_the_calibration_text_better(tiny, tmp_path):
    src = tiny.checkpoint("mixtral")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT * 60)
    rtn = convert_quantized(src, tmp_path / "rtn", group=32, down_group=16, progress=False)
    gptq = convert_quantized(
        src,
        tmp_path / "gptq",
        calibration=text,
        calibration_tokens=2048,
        group=32,
        down_group=16,
        progress=False,
    )
    assert Store(gptq).index["quantization"]["rounding"] == "gptq"
    full = tiny.store("mixtral")
    cfg = EngineConfig(native=False, device="cpu", dtype="float32")
    models = {
        name: load_model(path, cfg) for name, path in (("full", full), ("rtn", rtn), ("gptq", gptq))
    }
    ids = torch.tensor([models["full"].tokenizer.encode(TEXT)[:64]])
    with torch.no_grad():
        logits = {name: m.model(ids).logits for name, m in models.items()}
    err = {name: ((logits[name] - logits["full"]) ** 2).mean().item() for name in ("rtn", "gptq")}
    print(f"mean squared logit error on calibration text: {err}")
    assert err["gptq"] < err["rtn"]


def test_two_slot_budget_bit_identical_with_q2s(tiny, tmp_path):
    store = convert_quantized(tiny.checkpoint("gpt_oss"), tmp_path / "q2s", progress=False)
    ids = torch.randint(1, 320, (1, 10), generator=torch.Generator().manual_seed(1))
    full = load_model(store, EngineConfig(native=False, device="cpu"))
    small = load_model(store, EngineConfig(native=False, device="cpu", expert_cache_slots=2))
    with torch.no_grad():
        assert torch.equal(full.model(ids).logits, small.model(ids).logits)


def test_cli_prints_bits_per_weight(tiny, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moetier",
            "convert",
            str(tiny.checkpoint("qwen3_moe")),
            str(tmp_path / "s"),
            "--experts",
            "q2s",
            "--delta",
            "q2",
            "--override",
            "layers=0:nvfp4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    store = Store(tmp_path / "s")
    lines = out.stdout.splitlines()
    base = f"{store.plane_bits_per_weight('base'):.3f}"
    delta = f"{store.plane_bits_per_weight('delta'):.3f}"
    assert lines[1].strip().startswith(f"experts {base} bits per weight: nvfp4 (layers 0) ")
    assert "q2s-g32-down-g16 (layers 1)" in lines[1]
    assert lines[2].strip() == f"delta plane, where applied: +{delta} bits per weight: " + (
        f"q2s-g16-down-g16 {delta}"
    )
    assert lines[3].strip().startswith("whole store (dense ") and "with the delta plane" in lines[3]
    assert store.index["quantization"]["experts"] == "q2s"
    assert store.index["quantization"]["delta"] == "q2"


@pytest.mark.gpu
def test_q2s_store_on_cuda_matches_cpu(tiny, tmp_path, monkeypatch):
    from dataclasses import replace

    from moetier.kernels import moe_triton

    store = convert_quantized(tiny.checkpoint("deepseek_v3"), tmp_path / "q2s", progress=False)
    ids = torch.randint(1, 320, (2, 12), generator=torch.Generator().manual_seed(2))
    cpu = load_model(store, EngineConfig(native=False, device="cpu", dtype="float32"))
    gpu = load_model(store, EngineConfig(native=False, device="cuda", dtype="float32"))
    with torch.no_grad():
        a = cpu.model(ids).logits
        # the default decode kernel rounds activations to int8 per 16 columns (the CPU path
        # does not): about 1e-3 here, against 0.1 for a wrong layout
        assert (a - gpu.model(ids.cuda()).logits.cpu()).abs().max() < 5e-3
        # with float activations the kernels decode exactly what the CPU path does (the per-pair
        # GEMV: the grouped kernel, which the dispatcher picks where experts are shared, always
        # rounds activations to int8)
        monkeypatch.setattr(moe_triton, "choose_q2s_grouped", lambda *a, **k: None)
        choose = moe_triton.choose_q2s_gemv
        monkeypatch.setattr(
            moe_triton,
            "choose_q2s_gemv",
            lambda n, k, *rest: replace(choose(n, k, *rest), int8_act=False),
        )
        b = gpu.model(ids.cuda()).logits.cpu()
    assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("kind", "bpw"), [("nvfp4", 4.5), ("mxfp4", 4.25), ("int2", 2.5), ("affine2", 3.0)]
)
def test_coded_store_equals_fake_quant(tiny, tmp_path, kind, bpw):
    from transformers import AutoModelForCausalLM

    from moetier.quant.baselines import quantize_affine2, quantize_int2
    from moetier.quant.fp4 import quantize_mxfp4, quantize_nvfp4

    quantize = {
        "nvfp4": quantize_nvfp4,
        "mxfp4": quantize_mxfp4,
        "int2": lambda w: quantize_int2(w, 32),
        "affine2": lambda w: quantize_affine2(w, 32),
    }[kind]
    src = tiny.checkpoint("glm4_moe")
    store = Store(convert_quantized(src, tmp_path / kind, kind, progress=False))
    want = {"experts": kind}
    if kind in ("int2", "affine2"):
        want.update(group=32, down_group=32)
    assert store.index["quantization"] == want
    # Bits per weight at the eval model's shape (tiny shapes are dominated by alignment padding).
    codec = MatrixCodec.parse(kind if kind.endswith("fp4") else f"{kind}-g32")
    fmt = coded_expert_format(codec, codec, 512, 256, False)
    assert 8 * fmt.nbytes / (3 * 512 * 256) == pytest.approx(bpw, abs=0.01)
    ref = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        for layer, path in store.moe_modules.items():
            mod = ref.get_submodule(path)
            for e in range(mod.gate_up_proj.shape[0]):
                for param, name in ((mod.gate_up_proj, "gate_up"), (mod.down_proj, "down")):
                    fake = quantize(param[e]).dequantize()
                    decoded = expert_matrix(store.blob(layer, e), store.blob_format(layer), name)
                    assert torch.equal(decoded, fake)
                    param[e] = fake
        loaded = load_model(store.path, EngineConfig(native=False, device="cpu", dtype="float32"))
        ids = torch.randint(1, 320, (2, 12), generator=torch.Generator().manual_seed(4))
        assert (loaded.model(ids).logits - ref(ids).logits).abs().max() < 1e-4


def test_calibration_is_for_q2s_only(tiny, tmp_path):
    with pytest.raises(ValueError, match="--calibration applies to --experts q2s"):
        convert_quantized(
            tiny.checkpoint("qwen3_moe"), tmp_path / "s", "nvfp4", calibration=tmp_path
        )
