"""`moetier tune`'s library (moetier/kernels/tune.py) and the tables the dispatcher reads
(moetier/kernels/tuned_tables.py, `moe_dispatch.tuned_configs`): the user table's name and
place, the lookup order, the search's order and time bound under a fake timer, a written table
read back by the dispatcher; on a GPU, a real tune of a few seconds."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

import pytest

from moetier.core.layout import fp4_expert_format, q2s_expert_format
from moetier.kernels import moe_dispatch, tuned_tables
from moetier.kernels import tune as tuning
from moetier.kernels.moe_dispatch import KernelChoice

QWEN = tuning.TuneShape("qwen3-30b-a3b", q2s_expert_format(2048, 768, False, 32, 16), None,
                        128, 8)  # fmt: skip


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The user cache in tmp_path, driver 570.1 and Triton 3.6.0 whatever the machine's; the
    dispatcher's tables read afresh."""
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(tuned_tables.TABLE_ENV, raising=False)
    monkeypatch.setattr(tuned_tables, "driver_version", lambda: "570.1")
    monkeypatch.setattr(tuned_tables, "triton_version", lambda: "3.6.0")
    moe_dispatch.tuned_configs.cache_clear()
    yield tmp_path / "cache"
    moe_dispatch.tuned_configs.cache_clear()


def test_user_table_name_and_place(monkeypatch, tmp_path):
    """Keyed by card, driver and Triton version, under $MOETIER_CACHE/kernels, else
    $XDG_CACHE_HOME/moetier/kernels, else ~/.cache/moetier/kernels."""
    name = tuned_tables.table_name("NVIDIA_GeForce_RTX_4090", "570.86.15", "3.6.0")
    assert name == "NVIDIA_GeForce_RTX_4090__driver-570.86.15__triton-3.6.0.json"
    assert tuned_tables.table_name("A B/C", "x y", "3.6") == "A_B_C__driver-x_y__triton-3.6.json"
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path / "c"))
    path = tuned_tables.user_table_path("NVIDIA_H100", "570.1", "3.6.0")
    assert path == tmp_path / "c" / "kernels" / "NVIDIA_H100__driver-570.1__triton-3.6.0.json"
    monkeypatch.delenv("MOETIER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert tuned_tables.user_table_path("C", "1", "2").parent == tmp_path / "x/moetier/kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuned_tables.cache_root() == tmp_path / "home/.cache/moetier"


def _write(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))


def test_lookup_order_user_then_shipped_then_architecture_then_defaults(
    cache, monkeypatch, tmp_path, caplog
):
    """The user's table for this card, driver and Triton first (entry by entry), over the
    card's shipped table, else over a same-architecture card's; else the generic defaults. What
    was taken is logged once."""
    shipped = tmp_path / "configs"
    monkeypatch.setattr(moe_dispatch, "CONFIG_DIR", shipped)
    monkeypatch.setattr(moe_dispatch, "TUNED_CAPABILITY", {"CARD_A": (9, 0), "CARD_B": (8, 9)})
    monkeypatch.setattr(moe_dispatch, "_capability", lambda: (9, 0))
    card_a = {"q2s-gemv:1x1": {"block_n": 1}, "q2s-gemv:2x2": {"block_n": 2}}
    _write(shipped / "CARD_A.json", card_a)
    _write(shipped / "CARD_B.json", {"q2s-gemv:1x1": {"block_n": 9}})
    _write(tuned_tables.user_table_path("CARD_A"),
           {"_about": {"card": "CARD_A"}, "q2s-gemv:1x1": {"block_n": 5}})  # fmt: skip
    caplog.set_level(logging.INFO, logger="moetier.kernels.moe_dispatch")

    table = moe_dispatch.tuned_configs("CARD_A")
    assert table == {"q2s-gemv:1x1": {"block_n": 5}, "q2s-gemv:2x2": {"block_n": 2}}
    moe_dispatch.tuned_configs("CARD_A")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "tuned on this card" in said[0] and "shipped for CARD_A" in said[0]
    assert said[0].index("tuned on this card") < said[0].index("shipped for CARD_A")
    assert all(r.levelno == logging.INFO for r in caplog.records)  # no warning spam

    # an sm_90 card without its own table: CARD_A's (same architecture), under its own user table
    caplog.clear()
    assert moe_dispatch.tuned_configs("CARD_C")["q2s-gemv:1x1"] == {"block_n": 1}
    assert "shipped for CARD_A (same architecture)" in caplog.records[0].getMessage()
    moe_dispatch.tuned_configs.cache_clear()
    _write(tuned_tables.user_table_path("CARD_C"), {"q2s-gemv:1x1": {"block_n": 7}})
    assert moe_dispatch.tuned_configs("CARD_C")["q2s-gemv:1x1"] == {"block_n": 7}
    assert moe_dispatch.tuned_configs("CARD_C")["q2s-gemv:2x2"] == {"block_n": 2}

    # another driver: the user table is not this one's
    monkeypatch.setattr(tuned_tables, "driver_version", lambda: "580.2")
    moe_dispatch.tuned_configs.cache_clear()
    assert moe_dispatch.tuned_configs("CARD_C")["q2s-gemv:1x1"] == {"block_n": 1}

    # an architecture nobody tuned: the generic defaults, said
    monkeypatch.setattr(moe_dispatch, "_capability", lambda: (8, 6))
    caplog.clear()
    assert moe_dispatch.tuned_configs("CARD_D") == {}
    assert caplog.records[0].getMessage().endswith("generic defaults")
    caplog.clear()
    assert moe_dispatch.tuned_configs("cpu") == {} and not caplog.records

    # a table forced by the environment, alone
    monkeypatch.setenv(tuned_tables.TABLE_ENV, "defaults")
    moe_dispatch.tuned_configs.cache_clear()
    assert moe_dispatch.tuned_configs("CARD_A") == {}
    monkeypatch.setenv(tuned_tables.TABLE_ENV, str(shipped / "CARD_B.json"))
    moe_dispatch.tuned_configs.cache_clear()
    assert moe_dispatch.tuned_configs("CARD_A") == {"q2s-gemv:1x1": {"block_n": 9}}


def test_untuned_hint_only_where_the_card_has_no_table(cache, monkeypatch, tmp_path):
    """How to tune is said on a CUDA card with neither a user nor a shipped table of its own
    (even where its architecture's is taken), not on CPU or a tuned card."""
    monkeypatch.setattr(moe_dispatch, "_device_name", lambda: "NVIDIA_H100_80GB_HBM3")
    monkeypatch.setattr(moe_dispatch, "_capability", lambda: (9, 0))
    hint = moe_dispatch.untuned_hint("/models/qwen")
    assert hint and "moetier tune /models/qwen" in hint and "NVIDIA_H200's" in hint
    assert str(tuned_tables.user_table_path("NVIDIA_H100_80GB_HBM3")) in hint
    _write(tuned_tables.user_table_path("NVIDIA_H100_80GB_HBM3"), {})
    assert moe_dispatch.untuned_hint() is None
    monkeypatch.setattr(moe_dispatch, "_device_name", lambda: "NVIDIA_H200")
    assert moe_dispatch.untuned_hint() is None
    monkeypatch.setattr(moe_dispatch, "_device_name", lambda: "cpu")
    assert moe_dispatch.untuned_hint() is None


def test_jobs_most_valuable_first():
    """Decode at 1 token of every shape first, then 2, 4, 8, then calls with a delta plane and
    prefill; each decode size its own `:p<pairs>` entry; the pair the dispatcher takes now is
    where each starts, and the H200's most frequent winners lead the tiles."""
    nvfp4 = fp4_expert_format("nvfp4", 2048, 768, False)
    delta = replace(QWEN, label="delta", delta=nvfp4)
    other = tuning.TuneShape("nvfp4", nvfp4, None, 128, 8)
    with moe_dispatch.using_table({}):
        jobs = tuning.jobs_for([delta, other])
    labels = [j.label for j in jobs]
    assert labels[:2] == ["delta decode 1", "nvfp4 decode"]
    assert labels[2:5] == ["delta decode 2", "delta decode 4", "delta decode 8"]
    assert labels[5:] == ["delta decode with delta", "delta prefill 512", "delta prefill 4096",
                          "nvfp4 prefill 512", "nvfp4 prefill 4096"]  # fmt: skip
    assert jobs[0].keys == ("q2s-gemv:1536x2048:p8", "q2s-gemv:2048x768:p8")
    assert jobs[3].keys[0] == "q2s-gemv:1536x2048:p32"
    assert jobs[5].keys[0] == "q2s-gemv-delta:1536x2048"
    assert jobs[6].keys[0] == "q2s-mma:1536x2048:m32" and jobs[7].keys[0].endswith(":m128")
    assert jobs[1].keys[0] == "gemv:1536x2048" and jobs[1].tokens == (1, 2, 4, 8)
    assert jobs[0].start == (moe_dispatch.Q2S_GEMV, moe_dispatch.Q2S_GEMV)
    first = jobs[0].gu_cands[0]
    assert (first.block_n, first.block_k, first.num_warps) == (64, 512, 4)
    assert [j.weight for j in jobs[:5]] == [4.0, 4.0, 3.0, 2.0, 2.0]
    # on another architecture the sm_90-only options are left out
    options = tuning.jobs_for([QWEN], [1], [], sm90=False)[0].options
    assert options and not any(k in tuning.SM90_ONLY for _, o in options for k in o)


class FakeGpu:
    """A timer whose clock moves 1 s a timed call; gate_up is fastest at block_n 32 and
    block_k 1024, down with group_acc, gluon on gate_up saves 10%."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[tuple[str, int, KernelChoice, KernelChoice]] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, job, tokens, c_gu, c_dn):
        self.now += 1.0
        self.calls.append((job.label, tokens, c_gu, c_dn))
        ms = 1.0 + abs(c_gu.block_n - 32) / 64 + abs(c_gu.block_k - 1024) / 1024
        ms *= 0.9 if c_gu.gluon else 1.0
        return tokens * (ms + (0.0 if c_dn.group_acc else 0.3))


def test_search_order_and_time_bound():
    """The start pair is timed first, then gate_up's tiles in order; the bound stops the search
    where it is and keeps the best so far; each job gets its weight's share of the time left, so
    later jobs run too; jobs past the bound are not started."""
    gpu = FakeGpu()
    with moe_dispatch.using_table({}):
        jobs = tuning.jobs_for([QWEN], [1, 2], [512])
    results = tuning.tune(jobs, gpu, 30.0, gpu.clock)
    assert gpu.now <= 31.0  # the bound, and at most the one pair being timed past it
    assert [r.job.label for r in results] == ["qwen3-30b-a3b decode 1", "qwen3-30b-a3b decode 2",
                                              "qwen3-30b-a3b prefill 512"]  # fmt: skip
    first = [c for c in gpu.calls if c[0] == results[0].job.label]
    assert (first[0][2], first[0][3]) == jobs[0].start  # the dispatcher's pair first
    # then the tiles in order (the first is the start's gate_up, timed once)
    assert jobs[0].gu_cands[0] == jobs[0].start[0]
    assert [c[2] for c in first[1:4]] == jobs[0].gu_cands[1:4]
    # 30 s by weights 4 : 3 : 1: about 15, 11 and 4 timed pairs
    assert 13 <= results[0].timed <= 16 and not results[0].complete
    assert 9 <= results[1].timed <= 13 and 3 <= results[2].timed <= 6
    best = results[0].best[0]
    assert (best.block_n, best.block_k) == (32, 1024) and results[0].speedup > 1.3
    # no time at all: nothing started
    assert tuning.tune(jobs, gpu, 0.0, gpu.clock) == []


def test_search_runs_every_candidate_given_time():
    """Unbounded, the search times each distinct pair once: every gate_up tile, every down tile
    with the best gate_up, then options (greedy), and finds the fake's optimum."""
    gpu = FakeGpu()
    with moe_dispatch.using_table({}):
        job = tuning.jobs_for([QWEN], [1], [])[0]
    result = tuning.search(job, gpu, math.inf, gpu.clock)
    assert result is not None and result.complete
    assert len(gpu.calls) == result.timed <= job.size
    c_gu, c_dn = result.best
    assert (c_gu.block_n, c_gu.block_k, c_gu.gluon, c_dn.group_acc) == (32, 1024, True, True)
    assert len({(c[2], c[3]) for c in gpu.calls}) == len(gpu.calls)


def test_written_table_is_what_the_dispatcher_then_takes(cache, monkeypatch):
    """run_tune writes the winners into the card's user table (with a note of card and
    versions, merged with what was there); KernelChoice rebuilt from an entry equals the winner;
    the dispatcher takes them on that card; entries of other keys are kept."""
    monkeypatch.setattr(moe_dispatch, "_device_name", lambda: "NVIDIA_FAKE")
    monkeypatch.setattr(moe_dispatch, "_capability", lambda: (8, 9))
    path = tuned_tables.user_table_path("NVIDIA_FAKE")
    _write(path, {"q2s-gemv:512x256": {"block_n": 16}})
    gpu = FakeGpu()
    report = tuning.run_tune([QWEN], 1000.0, gpu, decode_tokens=[1], prefill_tokens=[],
                             progress=False, clock=gpu.clock)  # fmt: skip
    assert report.path == path and report.jobs == 1 and report.results[0].complete
    data = json.loads(path.read_text())
    assert data["_about"]["card"] == "NVIDIA_FAKE" and data["_about"]["triton"] == "3.6.0"
    assert data["q2s-gemv:512x256"] == {"block_n": 16}
    c_gu, c_dn = report.results[0].best
    entry = data["q2s-gemv:1536x2048:p8"]
    assert replace(moe_dispatch.Q2S_GEMV, **entry) == c_gu
    assert moe_dispatch.choose_q2s_gemv(1536, 2048, pairs=8) == c_gu
    assert moe_dispatch.choose_q2s_gemv(2048, 768, pairs=8) == c_dn
    # calls of more pairs than tuned keep the tables before (here: the generic defaults)
    assert moe_dispatch.choose_q2s_gemv(1536, 2048, pairs=16) == moe_dispatch.Q2S_GEMV


@pytest.mark.gpu
def test_real_tune_of_a_few_seconds_is_used(cache):
    """On the GPU: 20 s of tuning Qwen3-30B-A3B's 1-token decode from the generic defaults
    writes this card's table; the dispatcher then takes its entries, and the op runs with
    them."""
    import torch

    from moetier.quant.synthetic import random_blob

    timer = tuning.GpuTimer(lambda f, g: random_blob(f, g, fitted_grid=False))
    report = tuning.run_tune([QWEN], 20.0, timer, from_defaults=True, decode_tokens=[1],
                             prefill_tokens=[], progress=False)  # fmt: skip
    assert report.wall_s < 40 and report.results and report.results[0].timed >= 2
    assert report.path == tuned_tables.user_table_path(moe_dispatch._device_name())
    c_gu, c_dn = report.results[0].best
    assert moe_dispatch.choose_q2s_gemv(1536, 2048, pairs=8) == c_gu
    assert moe_dispatch.choose_q2s_gemv(2048, 768, pairs=8) == c_dn
    case = timer.case
    assert case is not None
    r = case.routings(1, 1, seed=0)[0]
    case.call(r, None)  # the dispatcher's choice: the tuned pair
    torch.cuda.synchronize()
    assert torch.isfinite(r["out"]).all()


@pytest.mark.parametrize(
    "text, said",
    [
        ('{"gemv:8x8": {"block_k": 64', "cannot be read"),
        ("[1, 2]", "is not a JSON object"),
        (
            '{"gemv:8x8": {"block_k": 64, "tile_q": 3}}',
            "fields this moetier does not know (tile_q)",
        ),
        ('{"gemv:8x8": 5}', "(not an object)"),
    ],
)
def test_a_broken_table_is_refused_naming_the_file(tmp_path, monkeypatch, text, said):
    """What the dispatcher reads (the user's table here, through $MOETIER_KERNEL_CONFIGS)."""
    from moetier.kernels import moe_dispatch

    path = tmp_path / "card.json"
    path.write_text(text)
    monkeypatch.setenv("MOETIER_KERNEL_CONFIGS", str(path))
    moe_dispatch.tuned_configs.cache_clear()
    with pytest.raises(ValueError, match="moetier tune") as err:
        moe_dispatch.tuned_configs("NVIDIA_H200")
    assert said in str(err.value) and str(path) in str(err.value)
    path.write_text('{"_about": {"card": "x"}, "gemv:8x8": {"block_k": 64}}')
    moe_dispatch.tuned_configs.cache_clear()
    assert moe_dispatch.tuned_configs("NVIDIA_H200") == {"gemv:8x8": {"block_k": 64}}
    moe_dispatch.tuned_configs.cache_clear()
