"""The experts kernels the dispatcher chooses, and the rest of a decode step's kernels (dense
GEMV, paged attention, K/V write, router), compile for every architecture users have (sm_80,
86, 89, 90, 100, 120), without a GPU: bench/cross_compile.py (moetier/kernels/cross_compile.py:
Triton's compiler and bundled ptxas, the wrappers run on CPU tensors of the Qwen3-30B-A3B shape
as they would on such a GPU) in a subprocess, since this process's Triton is in interpreter mode
(conftest). Every expert format and delta plane, decode (1 token) and prefill (64 tokens); the
full sweep over the families' shapes is the script's default (docs/kernels.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def sweep(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (Triton 3.9 warns when it is unset)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "cross_compile.py"), *args],
                         capture_output=True, text=True, env=env, timeout=1200)  # fmt: skip
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, (run.stderr[-3000:], [x for x in lines if "error" in x])
    return lines


@pytest.mark.slow
def test_experts_kernels_compile_for_every_architecture():
    lines = sweep("--shapes", "qwen3-30b-a3b", "--tokens", "1,64")
    summary = lines[-1]
    assert summary["summary"] and summary["failures"] == 0
    records = lines[:-1]
    caps = {r["cap"] for r in records}
    assert caps == {80, 86, 89, 90, 100, 120}
    others = {"_dense_gemv_kernel", "_decode_attention_kernel", "_write_kv_kernel",
              "_router_topk_kernel"}  # fmt: skip
    for cap in caps:  # every format, decode and prefill, and the step's other kernels
        mine = [r for r in records if r["cap"] == cap]
        cases = {(r["format"], r["tokens"]) for r in mine if r["format"] != "-"}
        assert len(cases) == 7 * 2, (cap, sorted(cases))
        assert {r["kernel"] for r in mine if r["format"] == "-"} == others
    assert all(0 < r["registers"] <= 255 for r in records)


def test_a_failing_case_fails_the_sweep():
    """A case that cannot be built (here an expert format that does not exist) is a failure
    line and a non-zero exit, not a skip."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cross_compile.py"), "--caps", "90",
         "--shapes", "qwen3-30b-a3b", "--formats", "nope", "--tokens", "1"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 1
    assert "error" in lines[0] and lines[-1]["failures"] == 1


def test_a_card_without_its_own_table_takes_its_architectures(monkeypatch, caplog, tmp_path):
    """An H100 (sm_90, no table of its own) gets the H200's tuned configs and says so once; a
    card of an architecture nobody tuned gets the generic defaults and says that; CPU is
    silent. (No user table: the cache is an empty folder.)"""
    import logging

    from moetier.kernels import moe_dispatch

    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger="moetier.kernels.moe_dispatch")
    h200 = moe_dispatch.CONFIG_DIR / "NVIDIA_H200.json"
    moe_dispatch.tuned_configs.cache_clear()
    monkeypatch.setattr(moe_dispatch, "_capability", lambda: (9, 0))
    table = moe_dispatch.tuned_configs("NVIDIA_H100_80GB_HBM3")
    assert table == json.loads(h200.read_text()) and table
    moe_dispatch.tuned_configs("NVIDIA_H100_80GB_HBM3")  # cached: said once
    said = " / ".join(r.getMessage() for r in caplog.records)
    assert said.count("shipped for NVIDIA_H200 (same architecture)") == 1
    caplog.clear()
    moe_dispatch.tuned_configs.cache_clear()
    monkeypatch.setattr(moe_dispatch, "_capability", lambda: (8, 6))
    assert moe_dispatch.tuned_configs("NVIDIA_GeForce_RTX_3090") == {}
    assert "generic defaults" in caplog.records[0].getMessage()
    caplog.clear()
    assert moe_dispatch.tuned_configs("cpu") == {} and not caplog.records
    moe_dispatch.tuned_configs.cache_clear()
