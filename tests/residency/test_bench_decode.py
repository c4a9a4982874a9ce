"""bench/decode.py --tiered runs on CPU with a tiny shape and prints well-formed lines; its
trace routing maps a recorded trace onto the bench shape as bench/trace_routing.py says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import trace_routing  # noqa: E402


def test_tiered_decode_bench_smoke(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "decode.py"), "--tiered", "--device", "cpu",
               "--layers", "2", "--shape", "tiny", "--steps", "3", "--gpu-fraction", "0.25,1.0",
               "--disk-fraction", "0,0.25", "--accelerate-tokens", "3", "--prefill-tokens", "300",
               "--tmp", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    links = lines[0]
    assert links["case"] == "links" and all(links[f"{k}_GB/s"] > 0 for k in ("hbm", "h2d", "disk"))
    offload = [r for r in lines if r["case"] == "decode-accelerate"]  # HF + accelerate baseline
    assert [r["gpu_fraction"] for r in offload] == [0.25]
    assert "tok_s" in offload[0], (offload[0], done.stderr[-3000:])  # a failed case: its error
    assert offload[0]["tok_s"] > 0
    prefill = [r for r in lines if r["case"] == "prefill-tiered"]  # streamed from the host tier
    assert [r["gpu_fraction"] for r in prefill] == [0.25] and prefill[0]["host_MB"] > 0
    p = prefill[0]
    assert p["of_floor"] == pytest.approx(p["floor_ms"] / p["ms"], rel=0.05, abs=2e-3)
    # 300 tokens x top-4 of 32 experts: every expert of both layers is needed, each crosses once
    assert p["needed_MB"] == pytest.approx(64 * links["blob_bytes"] / 1e6, abs=0.01)
    assert p["host_MB"] == pytest.approx(p["needed_MB"], abs=0.01)
    assert p["resident_host_MB"] == 0 and p["resident_ms"] > 0 and p["pinned_ms"] > 0
    assert p["identical_logits"] is True  # streamed, resident and pinned: bit for bit
    assert p["bound_ms"] == pytest.approx(max(p["floor_ms"], p["resident_ms"]), abs=2e-3)
    assert p["of_bound"] == pytest.approx(p["bound_ms"] / p["ms"], rel=0.05, abs=2e-3)
    lines = [r for r in lines if r["case"] not in ("decode-accelerate", "prefill-tiered")]
    cases = {(r["gpu_fraction"], r["disk_fraction"]): r for r in lines[1:]}
    assert set(cases) == {(1.0, 0.0), (0.25, 0.0), (0.25, 0.25)}
    assert cases[(1.0, 0.0)]["strategy"] == "resident" and cases[(1.0, 0.0)]["hit_rate"] == 1.0
    # no disk: the cost model may pick any strategy; with blobs on disk, zero-copy cannot serve
    assert cases[(0.25, 0.25)]["strategy"] in ("blocking", "prefetch")
    assert cases[(0.25, 0.25)]["predicted_ms"]["zero_copy"] is None
    assert cases[(0.25, 0.25)]["bytes_per_token"]["disk"] > 0
    for r in lines[1:]:
        assert r["tok_s"] > 0 and r["ms_per_token"] > 0 and r["floor_ms"] > 0
        assert r["ratio_to_floor"] == pytest.approx(r["ms_per_token"] / r["floor_ms"], rel=0.01)
        assert r["gpu_slots"] == max(1, round(r["gpu_fraction"] * 64))  # 2 layers x 32 experts
    assert 0 < cases[(0.25, 0.0)]["hit_rate"] < 1
    assert cases[(0.25, 0.0)]["vs_accelerate"] == pytest.approx(
        cases[(0.25, 0.0)]["tok_s"] / offload[0]["tok_s"], rel=0.05
    )


def synthetic_trace(layers: int, tokens: int, experts: int, k: int, seed: int = 0):
    """ids [layers, tokens, k] (distinct per token) and descending probabilities."""
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(experts)[:k] for _ in range(tokens)] for _ in range(layers)])
    probs = np.sort(rng.random((layers, tokens, k)), axis=-1)[..., ::-1]
    return ids.astype(np.uint8), probs.astype(np.float16)


def test_trace_maps_onto_the_qwen3_shape_as_documented():
    """eval-moe-70m's layout (5 layers, 32 experts, top-4) onto 8 layers x 128 experts, top-8:
    group g of layer l is source s = 4l + g, i.e. trace layer s mod 5 at offset (s div 5) x
    (T div 7), its two highest-weight experts shifted by 32 g; weights renormalised."""
    ids, probs = synthetic_trace(5, 700, 32, 4)
    shuffled = np.random.default_rng(1).permutation(4)  # the ranking comes from the weights
    ids, probs = ids[..., shuffled], probs[..., shuffled]
    out_ids, out_w = trace_routing.map_trace(ids, probs, 32, 8, 128, 8)
    assert out_ids.shape == out_w.shape == (8, 700, 8)
    assert np.allclose(out_w.sum(-1), 1, atol=1e-5)
    stride = 700 // 7
    for layer, g, t in [(0, 0, 0), (3, 2, 650), (7, 3, 699), (5, 1, 123)]:
        s = layer * 4 + g
        row = (t + (s // 5) * stride) % 700
        src_ids, src_p = ids[s % 5, row], probs[s % 5, row].astype(np.float32)
        best = src_ids[np.argsort(-src_p, kind="stable")[:2]]
        assert list(out_ids[layer, t, 2 * g : 2 * g + 2]) == list(best + 32 * g)
    for layer in range(8):  # 8 distinct experts per token, 2 in each group of 32
        assert all(len(set(row)) == 8 for row in out_ids[layer].tolist())
        assert np.array_equal(np.sort(out_ids[layer] // 32, axis=-1)[0], [0, 0, 1, 1, 2, 2, 3, 3])
    with pytest.raises(ValueError, match="multiple of the trace's"):
        trace_routing.map_trace(ids, probs, 32, 8, 48, 8)
    with pytest.raises(ValueError, match="experts per group"):
        trace_routing.map_trace(ids, probs, 32, 8, 128, 6)


def test_trace_router_replays_rows_in_order_and_the_oracle_counts_them():
    ids = torch.tensor([[0, 1], [2, 3], [0, 2]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]])
    router = trace_routing.TraceRouter(ids, weights, torch.nn.Linear(4, 4))
    got, w = router(torch.zeros(2, 4, dtype=torch.bfloat16))  # rows 0, 1
    assert got.tolist() == [[0, 1], [2, 3]] and w.dtype == torch.bfloat16
    got, _ = router(torch.zeros(2, 4))  # rows 2, then wrap to 0
    assert got.tolist() == [[0, 2], [0, 1]] and int(router.cursor) == 4
    counts = trace_routing.trace_counts(ids[None].numpy(), range(1, 4), 4)  # rows 1, 2, 0
    assert counts.tolist() == [[2, 1, 2, 1]]
    assert trace_routing.oracle_hot_set(counts, 2).tolist() == [[True, False, True, False]]


def test_tiered_decode_bench_trace_routing_smoke(tmp_path):
    ids, probs = synthetic_trace(3, 400, 8, 4)  # onto 32 experts, top-4: 4 groups of 1
    trace_file = tmp_path / "trace.npz"
    np.savez(trace_file, expert_ids=ids, router_probs=probs)
    steps = 3
    command = [sys.executable, str(ROOT / "bench" / "decode.py"), "--tiered", "--device", "cpu",
               "--layers", "2", "--shape", "tiny", "--steps", str(steps), "--gpu-fraction", "0.25",
               "--routing", f"model,trace:{trace_file}", "--tmp", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    decode = {r["routing"]: r for r in lines if r["case"] == "decode-tiered"}
    assert set(decode) == {"model", "trace:trace.npz"}
    model, trace = decode["model"], decode["trace:trace.npz"]
    assert model["floor_kind"] == "uniform budget" and "trace_rows" not in model
    assert trace["floor_kind"] == "trace rows, best fixed GPU set"
    start, stop = trace["trace_rows"]
    assert stop - start == steps and start >= 16  # after the 16-token prompt
    assert 0 < trace["oracle_hit_rate"] <= 1 and 0 <= trace["hit_rate"] <= 1
    assert trace["ratio_to_floor"] == pytest.approx(
        trace["ms_per_token"] / trace["floor_ms"], rel=0.01
    )
    bad = command[:-4] + ["--routing", "trace:" + str(tmp_path / "missing.npz")] + command[-2:]
    done = subprocess.run(bad, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode != 0 and "cp ../shared/models/eval-moe-70m" in done.stderr


def test_a_failing_case_prints_an_error_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import decode

    real = decode.time_tiered

    def flaky(path, device, gpu_fraction, *args, **kwargs):
        if gpu_fraction == 0.25:
            raise RuntimeError("out of memory (simulated)")
        return real(path, device, gpu_fraction, *args, **kwargs)

    monkeypatch.setattr(decode, "time_tiered", flaky)
    argv = ["decode.py", "--tiered", "--device", "cpu", "--layers", "2", "--shape", "tiny",
            "--steps", "2", "--gpu-fraction", "0.25,1.0", "--strategy", "zero_copy",
            "--tmp", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    decode.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cases = [(r["case"], r.get("gpu_fraction"), "error" in r) for r in lines]
    # the given order (explicit strategy): 25% first, failed, then the resident case still runs
    assert cases == [("links", None, False), ("decode-tiered", 0.25, True),
                     ("decode-tiered", 1.0, False)]  # fmt: skip
    assert "out of memory (simulated)" in lines[1]["error"]
