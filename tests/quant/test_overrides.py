"""Per-layer and per-matrix format overrides: parsing, planning, and a mixed store that the
runtime decodes layer by layer, matrix by matrix."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.core.layout import MatrixCodec
from moetier.kernels.moe_ref import expert_matrix
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.quant.baselines import quantize_int2
from moetier.quant.fp4 import quantize_nvfp4
from moetier.quant.q2s import quantize_q2s
from moetier.quant.requantize import Override, layer_codecs
from moetier.quant.store import BLOB_ALIGN, Store

Q2S16, NVFP4 = MatrixCodec("q2s", 16), MatrixCodec("nvfp4", 16)


def test_parse():
    assert Override.parse("down=q2s-g16") == Override(Q2S16, ("down",), None)
    assert Override.parse("layers=0-1:nvfp4") == Override(NVFP4, ("gate_up", "down"), {0, 1})
    assert Override.parse("layers=0,3-5:gate_up=q2s-g16") == Override(
        Q2S16, ("gate_up",), {0, 3, 4, 5}
    )
    for bad in ("up=nvfp4", "layers=0-1", "layers=a:nvfp4", "down=q3", "layers=1:down=g16"):
        with pytest.raises(ValueError, match=r"--override .*the form is \[layers=L:\]"):
            Override.parse(bad)


def test_a_reversed_layer_range_is_refused():
    """`layers=1-0` was an empty range: the override silently changed nothing."""
    with pytest.raises(ValueError, match=r"'layers=0,3-2:nvfp4'.*the layer range '3-2' runs backw"):
        Override.parse("layers=0,3-2:nvfp4")
    assert Override.parse("layers=2-2:nvfp4").layers == {2}


def test_plan_last_wins_and_unknown_layers_refused():
    overrides = [
        Override.parse(t) for t in ("down=q2s-g16", "layers=1-2:nvfp4", "layers=2:down=int2-g32")
    ]
    plan = layer_codecs("q2s", 32, 32, overrides, [1, 2, 3])
    assert plan[1] == {"gate_up": NVFP4, "down": NVFP4}
    assert plan[2] == {"gate_up": NVFP4, "down": MatrixCodec("int2", 32)}
    assert plan[3] == {"gate_up": MatrixCodec("q2s", 32), "down": Q2S16}
    with pytest.raises(ValueError, match=r"layer\(s\) \[0\] that have no routed experts"):
        layer_codecs("q2s", 32, 16, [Override.parse("layers=0:nvfp4")], [1, 2])


def test_mixed_store_decodes_per_layer_and_matrix(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny.checkpoint("qwen3_moe")
    store = Store(
        convert_quantized(
            src,
            tmp_path / "mixed",
            "int2",
            overrides=["layers=0:nvfp4", "down=q2s-g16"],
            progress=False,
        )
    )
    assert store.blob_format(0).name == "nvfp4-down-q2s-g16"
    assert store.blob_format(1).name == "int2-g32-down-q2s-g16"
    assert store.index["quantization"]["overrides"] == {
        "0": {"gate_up": "nvfp4", "down": "q2s-g16"},
        "1": {"gate_up": "int2-g32", "down": "q2s-g16"},
    }
    assert store.verify() == []
    spans = sorted((b.offset, b.offset + b.nbytes) for b in store.blobs.values())
    assert all(a % BLOB_ALIGN == 0 for a, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))

    quantizers = {
        (0, "gate_up"): lambda w: quantize_nvfp4(w).dequantize(),
        (1, "gate_up"): lambda w: quantize_int2(w, 32).dequantize(),
        (0, "down"): lambda w: quantize_q2s(w, None, group=16).dequantize(),
        (1, "down"): lambda w: quantize_q2s(w, None, group=16).dequantize(),
    }
    ref = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        for layer, path in store.moe_modules.items():
            mod = ref.get_submodule(path)
            for e in range(8):
                for param, name in ((mod.gate_up_proj, "gate_up"), (mod.down_proj, "down")):
                    fake = quantizers[(layer, name)](param[e])
                    decoded = expert_matrix(store.blob(layer, e), store.blob_format(layer), name)
                    assert torch.equal(decoded, fake)
                    param[e] = fake
        loaded = load_model(store.path, EngineConfig(native=False, device="cpu", dtype="float32"))
        ids = torch.randint(1, 320, (2, 12), generator=torch.Generator().manual_seed(6))
        assert (loaded.model(ids).logits - ref(ids).logits).abs().max() < 1e-4


def test_bad_override_fails_before_converting(tiny, tmp_path):
    with pytest.raises(ValueError, match="--override 'down=q2s-g7'"):
        convert_quantized(tiny.checkpoint("qwen3_moe"), tmp_path / "s", overrides=["down=q2s-g7"])
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match="affine2: group 30 must be a multiple of 4"):
        convert_quantized(tiny.checkpoint("qwen3_moe"), tmp_path / "s", "affine2", group=30)
    assert not (tmp_path / "s").exists()
