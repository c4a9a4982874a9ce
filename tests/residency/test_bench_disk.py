"""bench/disk.py: picks a directory where O_DIRECT reads work (with a message for those it
skips) and prints raw and reader lines, the reader's against the best raw median."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import disk as disk_bench  # noqa: E402


def test_directory_choice_skips_refusing_filesystems(tmp_path, monkeypatch, capsys):
    refusing, working = tmp_path / "tmpfs", tmp_path / "ext4"
    refusing.mkdir()
    working.mkdir()
    monkeypatch.setattr(disk_bench, "ROOT", refusing)  # the first default candidate
    monkeypatch.setattr(disk_bench.Path, "cwd", staticmethod(lambda: working))  # the last
    monkeypatch.setattr(
        disk_bench, "direct_reads_work", lambda d: None if d == working else "Invalid argument"
    )
    assert disk_bench.choose_dir(None, 1 << 20) == working
    err = capsys.readouterr().err
    assert f"skipping {refusing}: Invalid argument" in err and "skipping /tmp" in err
    with pytest.raises(SystemExit, match="no directory"):
        disk_bench.choose_dir(refusing, 1 << 20)
    with pytest.raises(SystemExit, match="no directory"):  # no room for the file
        disk_bench.choose_dir(working, 1 << 60)


def test_disk_bench_lines(tmp_path, capsys):
    if disk_bench.direct_reads_work(tmp_path) is not None:
        pytest.skip("no O_DIRECT in the test's temporary directory (tmpfs)")
    disk_bench.main(["--dir", str(tmp_path), "--file-gib", "0.02", "--budget-s", "1",
                     "--repeat", "1", "--blob-bytes", "300000", "--batch", "4", "16",
                     "--raw-chunk-mib", "1", "--raw-queue-depths", "4"])  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    raw = [r for r in lines if r["what"].startswith("raw")]
    reader = [r for r in lines if r["what"].startswith("DiskReader")]
    assert len(raw) == 1 and raw[0]["gbps"] > 0
    # two batch sizes at the reader's queue depth, then the largest batch at --queue-depth-high
    assert [(r["batch"], r["queue_depth"]) for r in reader] == [(4, 16), (16, 16), (16, 32)]
    for r in reader:
        assert r["direct"] and r["of_raw"] == pytest.approx(r["gbps"] / raw[0]["gbps"], rel=0.02)
    assert not (tmp_path / disk_bench.FILE_NAME).exists()  # deleted without --keep
