"""bench/decode.py --tiered runs on CPU with a tiny shape and prints well-formed lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    assert [r["gpu_fraction"] for r in offload] == [0.25] and offload[0]["tok_s"] > 0
    prefill = [r for r in lines if r["case"] == "prefill-tiered"]  # streamed from the host tier
    assert [r["gpu_fraction"] for r in prefill] == [0.25] and prefill[0]["host_MB"] > 0
    assert prefill[0]["of_floor"] == pytest.approx(
        prefill[0]["floor_ms"] / prefill[0]["ms"], rel=0.05, abs=2e-3
    )
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
        assert r["gpu_slots"] == max(1, round(r["gpu_fraction"] * 32))  # 2 layers x 16 experts
    assert 0 < cases[(0.25, 0.0)]["hit_rate"] < 1
    assert cases[(0.25, 0.0)]["vs_accelerate"] == pytest.approx(
        cases[(0.25, 0.0)]["tok_s"] / offload[0]["tok_s"], rel=0.05
    )
