"""The `moetier` command as users run it."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "STORE", "--gpu-memory", "1GiB", "--batch", "-1"], "--batch -1: give 1 or more"),
        (["plan", "STORE", "--gpu-memory", "1GiB", "--batch", "0"], "--batch 0: give 1 or more"),
        (["plan", "STORE", "--gpu-memory", "1GiB", "--max-context", "0"], "--max-context 0"),
        (["plan", "STORE", "--gpu-memory", "1GiB", "--zero-copy-stage", "-1"], "give 0 or more"),
        (["plan", "STORE", "--gpu-memory", "1GiB", "--gpus", "0"], "--gpus 0: give 1 or more"),
        (["plan", "STORE", "--gpu-memory", "1GiB", "--experts", "bfloat16"],
         "--experts applies with --shape"),
        (["convert", "CKPT", "OUT", "--group", "64"],
         "--group: group sizes of --experts q2s, int2, affine2; --experts source has none"),
        (["convert", "CKPT", "OUT", "--experts", "nvfp4", "--down-group", "16"],
         "--down-group: group sizes"),
        (["convert", "CKPT", "OUT", "--experts", "q2s", "--group", "0"], "--group 0: give a group"),
        (["convert", "CKPT", "OUT", "--experts", "q2s", "--calibration-mode", "diag"],
         "--calibration-mode set how --calibration TEXT rounds"),
        (["convert", "CKPT", "OUT", "--gpu-memory", "24GiB", "--embeddings", "host"],
         "--gpu-memory, --embeddings: what --dense auto chooses"),
        (["generate", "STORE", "--prompt", "Hello", "--system", "Be brief.", "--device", "cpu"],
         "--system goes with --chat"),
        (["generate", "STORE", "--prompt", "Hello", "--expert-cache-mb", "-5", "--device", "cpu"],
         "--expert-cache-mb -5: give 0 (room for every expert) or more"),
    ],
)  # fmt: skip
def test_meaningless_and_ignored_flags_are_refused(tiny, tmp_path, capsys, argv, message):
    """Each was accepted: a negative batch planned a "KV cache -10 MiB", --group with source
    experts, --calibration-mode without --calibration, --system with --prompt and --experts
    beside a store were silently ignored. One line, exit 1, nothing written."""
    from moetier.cli.main import main

    where = {"STORE": str(tiny.store("qwen3_moe")), "CKPT": str(tiny.checkpoint("qwen3_moe")),
             "OUT": str(tmp_path / "out")}  # fmt: skip
    capsys.readouterr()  # the fixtures' building
    assert main([where.get(a, a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_flags_that_apply_still_pass(tiny, capsys):
    from moetier.cli.main import main

    store = str(tiny.store("qwen3_moe"))
    assert main(["plan", store, "--gpu-memory", "1GiB", "--batch", "2"]) == 0
    assert main(["plan", "--shape", "qwen3-30b-a3b", "--experts", "bfloat16", "--gpu-memory",
                 "80GiB"]) == 0  # fmt: skip
    assert "bfloat16 experts" in capsys.readouterr().out
