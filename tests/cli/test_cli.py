"""The `moetier` command as users run it."""

from __future__ import annotations

import subprocess
import sys

from moetier.config import EngineConfig
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model


def moetier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moetier", *args], capture_output=True, text=True, timeout=300
    )


def test_convert_then_generate(tiny, tmp_path):
    out = tmp_path / "store"
    done = moetier("convert", str(tiny.checkpoint("mixtral")), str(out))
    assert done.returncode == 0, done.stderr
    assert "2 MoE layers x 8 experts" in done.stdout
    gen = moetier(
        "generate",
        str(out),
        "--prompt",
        "Hello world",
        "--temperature",
        "0",
        "--max-new-tokens",
        "10",
        "--device",
        "cpu",
    )
    assert gen.returncode == 0, gen.stderr
    generator = Generator(load_model(out, EngineConfig(native=False, device="cpu")))
    expected = generator.generate(
        generator.prompt_ids("Hello world"), SamplingParams(max_new_tokens=10, temperature=0)
    )
    assert gen.stdout == expected.text + "\n"


def test_errors_are_messages_not_tracebacks(tiny, tmp_path):
    done = moetier("convert", str(tmp_path / "nowhere"), str(tmp_path / "out"))
    assert done.returncode == 1
    assert "config.json not found" in done.stderr and "Traceback" not in done.stderr
    done = moetier("convert", str(tiny.checkpoint("qwen3_moe")), str(tiny.store("qwen3_moe")))
    assert done.returncode == 1 and "--force" in done.stderr
    done = moetier("generate", str(tmp_path), "--prompt", "x")
    assert done.returncode == 1 and "not a moetier store" in done.stderr
    assert moetier("frobnicate").returncode == 2


def test_delta_nested_is_the_fp4_bit_plane_split(tiny, tmp_path):
    from moetier.quant.store import Store

    out = tmp_path / "nested"
    done = moetier("convert", str(tiny.checkpoint("qwen3_moe")), str(out), "--delta", "nested")
    assert done.returncode == 0, done.stderr
    store = Store(out)
    assert store.blob_format(store.moe_layers[0]).name == "nested-base"
    assert store.blob_format(store.moe_layers[0], "delta").name == "nested-delta"
    done = moetier(
        "convert", str(tiny.checkpoint("qwen3_moe")), str(tmp_path / "x"), "--experts", "q2s",
        "--delta", "nested",
    )  # fmt: skip
    assert done.returncode == 1 and "use --delta nvfp4 or q2" in done.stderr


def test_plan_prints_the_split_and_refuses_too_little(tiny):
    store = str(tiny.store("qwen3_moe"))
    done = moetier("plan", store, "--gpu-memory", "520MiB", "--host-memory", "1MiB")
    assert done.returncode == 0, done.stderr
    assert "GPU:  dense" in done.stdout and "16 of 16 base blobs" in done.stdout
    done = moetier("plan", store, "--gpu-memory", "100MiB")
    assert done.returncode == 1 and "raise --gpu-memory" in done.stderr
