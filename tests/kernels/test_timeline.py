"""bench/studies/timeline.py's figures from stamps whose answers are known: a chained call of one
gate_up launch (three programs placed before the release, one after it) and one down launch,
every call 10 µs after the one before."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "bench" / "studies"))
timeline = pytest.importorskip("timeline")


def _call(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stamps (ns) of the call whose gate_up's wait ends at t + 500: (start, before the wait,
    after it, end, SM) per program."""
    gu = [
        [t - 2000, t - 1500, t + 500, t + 3500, 0],
        [t - 2000, t - 1500, t + 500, t + 3500, 1],
        [t - 2000, t - 1500, t + 500, t + 3500, 2],
        [t + 1000, t + 1500, t + 1500, t + 4500, 0],
    ]  # a second wave: placed after release
    dn = [[t + 2000, t + 2500, t + 5000, t + 9000, sm] for sm in range(4)]  # fmt: skip
    return torch.tensor(gu, dtype=torch.int64), torch.tensor(dn, dtype=torch.int64)


def test_summarize_times_a_known_chain():
    rec = timeline.summarize([_call(10_000 * (i + 1)) for i in range(6)])
    assert rec["traced"] == ["gate_up", "down"]
    want = {
        "period": 10.0,
        "gu_release": 1.5,  # from the call before's last down end (t - 1000) to t + 500
        "gu_span": 4.0,  # to the late program's end
        "gu_after_wait": 3.0,
        "gu_before_wait": 0.5,
        "gu_late": 1.0,
        "gu_end_spread": 1.0,
        "gu_programs": 4.0,
        "gu_per_sm_max": 2.0,
        "dn_release": 0.5,  # from gate_up's last end (t + 4500)
        "dn_span": 4.0,
        "dn_after_wait": 4.0,
        "dn_late": 0.0,
        "timer_step_ns": 3000.0,  # the smallest gap between two programs' starts
    }
    for key, value in want.items():
        assert rec[key] == pytest.approx(value), key


def test_summarize_without_stamps_from_a_launch():
    """A launch that wrote none (the int8 rounding launch, say) is left out of the line."""
    calls = [(gu, dn[:0]) for gu, dn in (_call(10_000 * (i + 1)) for i in range(6))]
    rec = timeline.summarize(calls)
    assert rec["traced"] == ["gate_up"]
    assert "dn_span" not in rec and rec["gu_span"] == pytest.approx(4.0)
