"""`moetier plan --predict`'s link measurement (cli/plan_links.py) and the speed model it feeds
(residency/speed.py)."""

from __future__ import annotations

import json

import pytest

from moetier.cli import plan_links
from moetier.cli.main import main
from moetier.residency import speed
from moetier.residency.cost import LinkSpeeds
from moetier.residency.planner import Plan


def test_disk_read_of_a_temporary_file(tmp_path):
    read = plan_links.disk_read_bandwidth(tmp_path, nbytes=8 * 2**20, chunk=2**20, queue=4)
    assert read.bytes_per_s > 0 and read.nbytes == 8 * 2**20
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone


def test_disk_read_refuses_what_is_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        plan_links.disk_read_bandwidth(tmp_path / "nowhere")


def test_without_cuda_the_memory_links_are_defaults_and_said_so(tmp_path):
    said: list[str] = []
    links = plan_links.measure(tmp_path, cuda=False, say=said.append, disk_bytes=4 * 2**20)
    assert links.not_measured() == ["hbm", "h2d", "zero_copy"]
    assert links.speeds.hbm == speed.DEFAULT_LINKS.hbm
    assert links.speeds.disk > 0 and links.measured["disk"].endswith("read")
    assert any("not measured" in line for line in said)
    assert "not measured here: hbm, h2d, zero_copy" in links.describe()
    bare = plan_links.measure(None, cuda=False, say=said.append)
    assert bare.speeds == speed.DEFAULT_LINKS and len(bare.not_measured()) == 4


def test_plan_json_with_a_disk(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan_links, "DISK_BYTES", 4 * 2**20)
    rc = main(["plan", "tiny", "--gpu-memory", "600MiB", "--host-memory", "1GiB",
               "--disk", str(tmp_path), "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert "disk" in out["measured"] and out["links"]["disk_GB/s"] > 0
    assert out["best"] in out["candidates"]
    for c in out["candidates"]:
        assert set(c["decode_tok_s"]) == set(c["prefill_tok_s"]) == {"1", "16"}


def _plan(gpu_slots: int, host: int, base: int = 64, slot: int = 2**20) -> Plan:
    return Plan(
        dense_bytes=100 * 2**20,
        kv_bytes=0,
        workspace_bytes=0,
        slot_bytes=slot,
        base_blobs=base,
        delta_blobs=0,
        gpu_base_slots=gpu_slots,
        gpu_delta_slots=0,
        host_blobs=host,
        blobs_per_token=4 * 2,  # 4 MoE layers, top-2
    )


COUNTS = speed.ModelCounts(
    layers=4, experts=16, top_k=2, hidden=64, expert_params=3 * 64 * 128, dense_params=10**6,
    embed_gpu_bytes=10 * 2**20,
)  # fmt: skip
LINKS = LinkSpeeds(hbm=1e12, h2d=50e9, zero_copy=40e9, disk=2e9)
STEP = speed.StepCosts(decode_layer_s=1e-5, prefill_layer_s=1e-3, prefill_flops=1e14)


def test_decode_step_from_the_bytes_it_reads():
    # every expert on the GPU: dense (one embedding row) + 1 x 2 pairs x 4 layers at HBM speed
    seconds, how = speed.decode_seconds(_plan(64, 0), COUNTS, 1, LINKS, STEP)
    dense = 100 * 2**20 - 10 * 2**20 + 64 * 2
    assert how == "resident"
    assert seconds == pytest.approx((dense + 8 * 2**20) / 1e12 + 4e-5)
    # a quarter on the GPU, the rest in host RAM: the misses read in place at zero-copy speed
    seconds, how = speed.decode_seconds(_plan(16, 48), COUNTS, 1, LINKS, STEP)
    assert how == "zero_copy"
    expected = (dense + 0.25 * 8 * 2**20) / 1e12 + 0.75 * 8 * 2**20 / 40e9 + 4e-5
    assert seconds == pytest.approx(expected)
    # half of the misses on disk: no zero-copy; blocking fetches of the distinct missed experts
    seconds, how = speed.decode_seconds(_plan(16, 24), COUNTS, 1, LINKS, STEP)
    assert how == "blocking"
    fetched = 8 * 2**20 * 0.75  # one row: its 2 experts a layer are distinct
    expected = (
        (dense + 0.25 * 8 * 2**20 + fetched) / 1e12
        + fetched / 2 / 50e9
        + fetched / 2 / 2e9
        + fetched / 2 / 50e9
        + 4e-5
    )
    assert seconds == pytest.approx(expected)


def test_more_gpu_slots_and_rows_predict_as_they_should():
    slow = speed.predict(_plan(16, 48), COUNTS, LINKS, step=STEP)
    fast = speed.predict(_plan(48, 16), COUNTS, LINKS, step=STEP)
    assert fast.decode_tok_s[1] > slow.decode_tok_s[1]
    assert fast.decode_tok_s[16] > fast.decode_tok_s[1]  # a step of 16 rows, not 16 steps
    assert fast.prefill_tok_s[16] > fast.prefill_tok_s[1]
    assert slow.shares == speed.Shares(0.25, 0.75, 0.0)


def test_best_prefers_precision_within_near_best():
    def option(dense: str, tok_s: float) -> speed.Option:
        pred = speed.Prediction({1: tok_s}, {1: 1.0}, {1: 1.0}, "resident", speed.Shares(1, 0, 0))
        return speed.Option(dense, "gpu", _plan(64, 0), pred)

    assert speed.best([option("int4", 100), option("bf16", 95)]).dense == "bf16"
    assert speed.best([option("int4", 100), option("bf16", 80), option("fp8", 92)]).dense == "fp8"
    with pytest.raises(ValueError, match="no configuration fits"):
        speed.best([])


@pytest.mark.gpu
def test_links_measured_on_cuda_in_seconds(tmp_path):
    links = plan_links.measure(tmp_path)
    assert links.not_measured() == []
    assert links.speeds.hbm > links.speeds.h2d > 0 and links.speeds.zero_copy > 0
    assert links.seconds < 15


def test_plan_check_predicts_recorded_bench_lines():
    """bench/plan_check.py --from-lines on H100 lines in docs/results: the resident one-row
    line is where DEFAULT_STEP's decode and prefill times come from, so its prediction must
    give it back; the 25% budget lines are predictions the constants were not fitted to."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "plan_check.py"), "--from-lines",
         str(root / "docs" / "results" / "models-dense-budget-h100.jsonl")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    resident = [x for x in lines if x["gpu_slots"] == x["expert_blobs"] and x["batch"] == 1]
    assert len(resident) == 1
    assert resident[0]["ratio"] == pytest.approx(1.0, abs=0.02)
    assert resident[0]["prefill_ratio"] == pytest.approx(1.0, abs=0.05)
    budget = {x["batch"]: x for x in lines if x["gpu_slots"] < x["expert_blobs"]}
    assert set(budget) == {1, 4, 16, 64}
    assert all(x["ratio"] > 0 and x["predicted_decode_tok_s"] > 0 for x in budget.values())
