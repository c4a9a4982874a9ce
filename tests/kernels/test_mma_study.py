"""bench/q2s_mma_study.py's variants stay exact (Triton's interpreter on CPU): the study the
prefill kernel's next design will be chosen from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_mma_study_variants_are_exact():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, str(ROOT / "bench" / "q2s_mma_study.py"), "--check-only",
               "--device", "cpu", "--n", "64", "--k", "128", "--m", "32"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    checked = [r for r in lines if r["variant"] != "bf16"]
    assert {(r["variant"], r["grid"]) for r in checked} == {
        (v, g) for v in ("q2s_bf16_dot", "q2s_int8_mma") for g in ("b=3a", "fitted")
    }
    assert all(r["rel_err"] < 1e-6 for r in checked)
