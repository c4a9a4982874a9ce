"""`moetier bench` on the demo model and a synthetic shape, and `moetier generate`'s speed line,
run in-process through the CLI's entry point."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tiny_models import skip_without_transformers_family

from moetier.cli.main import main
from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model

FIGURES = ("prefill_s", "ttft_ms", "prefill_tok_s", "decode_s", "decode_tok_s", "ms_per_step",
           "floor_ms_per_step", "floor_tok_s", "ratio_to_floor")  # fmt: skip


def bench_lines(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[list[dict], str]:
    """The JSON lines of `moetier bench --json ARGS` on CPU, and its stderr."""
    assert main(["bench", "--device", "cpu", "--json", *args]) == 0
    captured = capsys.readouterr()
    return [json.loads(line) for line in captured.out.splitlines()], captured.err


def check_figures(line: dict, batch: int, prompt: int, new: int) -> None:
    """The counts are what was asked, the speeds are those counts over the times of the same
    line, the ratio is to the floor of the same line."""
    assert line["batch"] == batch
    assert line["tokens_in"] == batch * prompt and line["tokens_out"] == batch * new
    assert line["decode_tokens"] == batch * (new - 1)  # each row's first is the prefill's
    assert all(line[k] > 0 for k in FIGURES), {k: line[k] for k in FIGURES}
    assert line["ttft_ms"] == pytest.approx(line["prefill_s"] * 1e3, rel=1e-3)
    assert line["prefill_tok_s"] == pytest.approx(line["tokens_in"] / line["prefill_s"], rel=1e-3)
    assert line["decode_tok_s"] == pytest.approx(line["decode_tokens"] / line["decode_s"], 1e-3)
    assert line["ms_per_step"] == pytest.approx(line["decode_s"] / (new - 1) * 1e3, rel=1e-3)
    floor = line["floor_ms_per_step"]
    assert line["ratio_to_floor"] == pytest.approx(line["ms_per_step"] / floor, rel=1e-2)
    assert line["floor_tok_s"] == pytest.approx(batch * 1e3 / floor, rel=1e-2)
    assert 0 <= line["hit_rate"] <= 1


def test_bench_json_on_the_demo_model(capsys):
    lines, _ = bench_lines(
        capsys, "--no-native", "--batch", "1,2", "--prompt-tokens", "12", "--new-tokens", "5"
    )
    assert [line["batch"] for line in lines] == [1, 2]
    for line in lines:
        check_figures(line, line["batch"], 12, 5)
        assert line["store"] == DEFAULT_STORE.name and line["shape"] is None
        assert line["path"] == "transformers" and line["device_kind"] == "cpu"
        assert {"commit", "device", "torch", "transformers"} <= set(line)
        assert all(line[f"{k}_GB/s"] > 0 for k in ("hbm", "h2d", "disk"))
        # the demo model's experts all fit the (host) cache: nothing is missed in the floor
        assert line["cache_tier"] == "host" and line["floor_bytes_per_step"]["missed"] == 0
        assert line["bytes_per_token"]["host"] > 0 and line["bytes_per_token"]["gpu"] == 0
    # every dense weight (fp32 on CPU; the tied embedding is the head) and 4 experts a layer
    loaded = load_model(DEFAULT_STORE, EngineConfig(native=False, device="cpu"))
    dense = sum(p.numel() * 4 for p in loaded.model.parameters())
    blob = next(iter(loaded.store.blobs.values())).nbytes
    assert lines[0]["floor_bytes_per_step"]["active"] == dense + 5 * 4 * blob


def test_bench_native_batches_through_the_engine(capsys):
    lines, _ = bench_lines(capsys, "--native", "--batch", "3", "--prompt-tokens", "6",
                        "--new-tokens", "4", "--warmup", "0")  # fmt: skip
    assert len(lines) == 1 and lines[0]["path"] == "native"
    # the flags that differ from the defaults (--native is one)
    assert lines[0]["engine"] == {"device": "cpu"} and lines[0]["warmup_runs"] == 0
    check_figures(lines[0], 3, 6, 4)


def test_bench_a_synthetic_shape(capsys):
    lines, err = bench_lines(capsys, "--shape", "tiny", "--layers", "1", "--prompt-tokens", "8",
                             "--new-tokens", "3")  # fmt: skip
    assert len(lines) == 1 and lines[0]["shape"] == "tiny" and lines[0]["moe_layers"] == 1
    assert lines[0]["experts_format"][0].startswith("q2s")
    check_figures(lines[0], 1, 8, 3)
    said = re.search(r"writing a synthetic tiny store \(1 layers x 32 experts, random q2s "
                     r"weights, [\d.]+ MB\) to (\S+) \(removed after the run\)", err)  # fmt: skip
    assert said, err
    assert not Path(said.group(1)).exists()  # the temporary store is gone


def test_bench_a_synthetic_shape_with_a_delta_plane(capsys, tmp_path):
    """`--delta-plane nvfp4`: the synthetic store has a delta blob per expert (NVFP4), which the
    gate applies under --delta (a budget of a quarter of each call's pairs)."""
    from moetier.quant.store import Store
    from moetier.quant.synthetic import shape, synthetic_store_bytes, write_synthetic_store

    config = shape("tiny", 1)
    path = write_synthetic_store(tmp_path / "s", config, delta="nvfp4")
    store = Store(path)
    assert store.has_plane("delta") and len(store.blobs) == 2 * 32
    assert store.blob_format(store.moe_layers[0], "delta").name == "nvfp4"
    size = sum(f.stat().st_size for f in path.iterdir() if f.suffix != ".json")
    assert synthetic_store_bytes(config, delta="nvfp4") <= size
    lines, _ = bench_lines(capsys, "--shape", "tiny", "--layers", "1", "--delta-plane", "nvfp4",
                           "--delta", "budget:0.25:weight", "--native", "--prompt-tokens", "8",
                           "--new-tokens", "3", "--warmup", "0")  # fmt: skip
    assert lines[0]["experts_format"] == ["nvfp4", "q2s-g32-down-g16"]
    assert lines[0]["engine"]["delta"] == "budget:0.25:weight"
    check_figures(lines[0], 1, 8, 3)


def test_a_partial_budget_has_a_zero_copy_floor_too(capsys):
    """Experts beyond the GPU cache: beside the floor at the pinned copy rate, the floor of the
    path that reads misses zero-copy (the CUDA-graph step's), from the same line's speeds."""
    lines, _ = bench_lines(capsys, "--shape", "tiny", "--layers", "1", "--native",
                           "--expert-cache-slots", "8", "--host-memory", "1GiB", "--prompt-tokens",
                           "8", "--new-tokens", "4", "--warmup", "0")  # fmt: skip
    (line,) = lines
    check_figures(line, 1, 8, 4)
    moved = line["floor_bytes_per_step"]
    assert moved["missed"] > 0 and moved["disk"] == 0
    seconds = moved["active"] / (line["hbm_GB/s"] * 1e9) + moved["missed"] / (
        line["zero_copy_GB/s"] * 1e9
    )
    assert line["floor_zero_copy_ms_per_step"] == pytest.approx(seconds * 1e3, rel=1e-2)
    assert line["ratio_to_zero_copy_floor"] == pytest.approx(
        line["ms_per_step"] / line["floor_zero_copy_ms_per_step"], rel=1e-2
    )


@pytest.mark.parametrize("name", ["glm-5-tiny", "deepseek-v4-flash-tiny"])
def test_bench_a_real_shape_slice(capsys, name):
    """`moetier bench --shape glm-5 --layers 1` (and DeepSeek-V4-Flash) as its -tiny copy (a
    real GLM-5 layer is ~7 GB of store, too much for a CPU test), through the serving engine."""
    from moetier.quant import synthetic

    skip_without_transformers_family(synthetic.SHAPES[name]["model_type"])
    synthetic.meta_model(synthetic.SHAPES[name])
    lines, err = bench_lines(capsys, "--shape", name, "--layers", "1", "--prompt-tokens", "8",
                             "--new-tokens", "3", "--warmup", "0")  # fmt: skip
    (line,) = lines
    assert line["shape"] == name and line["moe_layers"] == 1
    assert line["model_type"] == synthetic.SHAPES[name]["model_type"]
    check_figures(line, 1, 8, 3)
    assert f"writing a synthetic {name} store (1 layers x 8 experts" in err


def test_bench_table(capsys):
    assert main(["bench", "--device", "cpu", "--batch", "1,2", "--prompt-tokens", "6",
                 "--new-tokens", "3", "--warmup", "0"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{DEFAULT_STORE.name}: qwen3_moe, 5 MoE layers")
    assert "links measured now: memory copy" in out[2]
    assert "warm-up: 0 untimed runs" in out[4]
    heading = out[5].split()
    assert heading[:3] == ["batch", "prefill", "tok/s"] and "floor" in heading
    rows = [row.split() for row in out[6:]]
    assert [int(row[0]) for row in rows] == [1, 2] and all(len(row) == 11 for row in rows)
    assert all(float(cell) > 0 for row in rows for cell in row[1:5])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--shape", "nope"],
            "unknown shape 'nope': the shapes are qwen3-30b-a3b, glm-5, deepseek-v4-flash, tiny, "
            "glm-5-tiny, deepseek-v4-flash-tiny",
        ),
        (["--new-tokens", "1"], "--new-tokens must be at least 2"),
        (["--batch", "1,x"], "--batch '1,x': batch sizes of 1 or more"),
        (["--layers", "2"], "--layers goes with --shape"),
    ],
)
def test_bench_errors_say_what_to_do(capsys, args, message):
    assert main(["bench", "--device", "cpu", *args]) == 1
    assert f"moetier bench: error: {message}" in capsys.readouterr().err


def test_generate_prints_its_speed_to_stderr(capsys):
    args = ["--prompt", "Once upon a time", "--max-new-tokens", "6", "--temperature", "0"]
    assert main(["generate", "--device", "cpu", *args]) == 0
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    found = re.fullmatch(
        r"moetier: (\d+) prompt tokens, (\d+) new tokens; prefill ([\d.]+) tok/s \(first "
        r"token after ([\d.]+) ms\), decode ([\d.]+) tok/s",
        last,
    )
    assert found, last
    generator = Generator(load_model(DEFAULT_STORE, EngineConfig(native=False, device="cpu")))
    ids = generator.prompt_ids("Once upon a time")
    done = generator.generate(ids, SamplingParams(max_new_tokens=6, temperature=0))
    assert captured.out == done.text + "\n"
    assert int(found.group(1)) == len(ids)
    assert int(found.group(2)) == len(done.token_ids) + (done.finish_reason == "stop")
    prompt_tok_s, ttft_ms = float(found.group(3)), float(found.group(4))
    assert prompt_tok_s == pytest.approx(len(ids) / (ttft_ms / 1e3), rel=0.01, abs=0.1)
    assert float(found.group(5)) > 0


@pytest.mark.gpu
def test_bench_on_cuda_with_its_floor(capsys):
    """On CUDA: the native path decodes from CUDA graphs, the links are the GPU's, and every
    step is slower than its floor (the demo model's bytes at copy speed take microseconds; a
    step's launches alone take longer)."""
    assert main(["bench", "--device", "cuda", "--json", "--native", "--batch", "1,4",
                 "--new-tokens", "16"]) == 0  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["batch"] for line in lines] == [1, 4]
    for line in lines:
        check_figures(line, line["batch"], 128, 16)
        assert line["device_kind"] == "cuda" and line["device"] == torch.cuda.get_device_name()
        assert line["path"] == "native, CUDA graphs, compiled, experts pinned"
        assert line["hit_rate"] == 1.0
        assert line["hbm_GB/s"] > 200 and line["h2d_GB/s"] > 5
        assert line["ratio_to_floor"] > 1
