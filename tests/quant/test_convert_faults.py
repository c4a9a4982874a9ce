"""Faults during conversion (#48 item 5): a real `moetier convert` killed (SIGKILL, SIGTERM,
SIGINT) at many points resumes into a store byte-identical to an uninterrupted one, writing only
what was missing; the destination lock, dead folders, free space, tokenizer files and damaged
shards."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moetier.quant import work_folder
from moetier.quant.convert import convert, work_path
from moetier.quant.sources import ConvertError
from moetier.quant.store import Store
from moetier.quant.work_folder import FAULT_ENV, LockedError

N_DENSE, N_BLOBS = 21, 16  # the tiny qwen3_moe checkpoint: 2 MoE layers x 8 experts


def _moetier(*args: str, fault: str | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = fault
    return subprocess.Popen(
        [sys.executable, "-m", "moetier.cli.main", "convert", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


def _same_tree(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _resumed_counts(log: str) -> tuple[int, int, int | None, int | None]:
    """(dense kept, blobs kept, dense written, blobs written) from a resumed run's log; what
    it wrote is said when it ends or is stopped by a signal it handles."""
    kept = re.search(r"(\d+) of \d+ dense tensors and (\d+) of \d+ expert blobs", log)
    wrote = re.search(r"this run wrote (\d+) dense tensors and (\d+) expert blobs", log)
    assert kept, log
    if wrote is None:
        return int(kept[1]), int(kept[2]), None, None
    return int(kept[1]), int(kept[2]), int(wrote[1]), int(wrote[2])


# Each run is stopped at the next point, resuming what the runs before it left:
# (MOETIER_FAULT_AT, exit code, (dense tensors, blobs) kept from earlier runs when it starts,
#  (dense tensors, blobs) committed when it stops)
CHAIN = [
    ("dense:5:TERM", 128 + signal.SIGTERM, None, (5, 0)),
    ("experts:4:INT", 128 + signal.SIGINT, (5, 0), (N_DENSE, 4)),
    ("experts:11:KILL", -signal.SIGKILL, (N_DENSE, 4), (N_DENSE, 11)),
    # blob 7 is damaged on disk before this run (below): it and those after are written again
    ("index:1:TERM", 128 + signal.SIGTERM, (N_DENSE, 7), (N_DENSE, N_BLOBS)),
    # SIGKILL while re-encoding the experts: the next run goes on after the sixth
    ("requantize:6:KILL", -signal.SIGKILL, (N_DENSE, N_BLOBS), (N_DENSE, N_BLOBS)),
    # re-encoded, not yet committed: the next run re-encodes from the kept unquantized experts
    ("finished:1:INT", 128 + signal.SIGINT, (N_DENSE, N_BLOBS), (N_DENSE, N_BLOBS)),
    ("publish:1:KILL", -signal.SIGKILL, (N_DENSE, N_BLOBS), (N_DENSE, N_BLOBS)),
    ("published:1:TERM", 128 + signal.SIGTERM, (N_DENSE, N_BLOBS), (N_DENSE, N_BLOBS)),
]


@pytest.mark.slow  # ten `moetier convert` processes: ~45 s on 2 cores
def test_killed_conversion_resumes_byte_identical(tiny, tmp_path):
    src = tiny.checkpoint("qwen3_moe")
    ref, out = tmp_path / "ref", tmp_path / "out"
    work = work_path(out.absolute())
    reference = _moetier(str(src), str(ref), "--experts", "q2s")
    for point, code, kept, stop in CHAIN:
        rc, log = _finish(_moetier(str(src), str(out), "--experts", "q2s", fault=point))
        assert rc == code, (point, log)
        if code > 0:  # SIGTERM / SIGINT: a clean stop that says how to go on
            assert "run the same command again to resume" in log, log
            assert "Traceback" not in log, log
        if kept is not None:
            dense_kept, blobs_kept, dense_wrote, blobs_wrote = _resumed_counts(log)
            assert (dense_kept, blobs_kept) == kept, (point, log)
            if code > 0:  # only what was missing is written: nothing twice
                assert (dense_wrote, blobs_wrote) == (stop[0] - kept[0], stop[1] - kept[1]), log
        if point == "experts:11:KILL":
            # a torn write (bytes after the last committed blob) and a committed blob damaged
            # on disk: the next run cuts the first and recomputes from the second on
            experts = work / "store" / "experts.bin"
            with open(experts, "ab") as f:
                f.write(b"\xff" * 5000)
            records = (work / "journal.jsonl").read_text().splitlines()
            seventh = json.loads(next(r for r in records if r.startswith('{"blob":7,')))
            with open(experts, "r+b") as f:
                f.seek(seventh["offset"] + 100)
                f.write(b"\x01\x02\x03")
        if point == "finished:1:INT":
            assert (work / "experts.raw.bin").exists()  # the unquantized experts kept beside
            # what the SIGKILLed run had re-encoded is kept, the rest re-encoded
            assert f"6 of {N_BLOBS} experts were re-encoded by an earlier run and are kept" in log
        if point.startswith("published"):
            assert out.exists()
        else:
            assert not out.exists() and work.is_dir()
    rc, log = _finish(_moetier(str(src), str(out), "--experts", "q2s"))
    assert rc == 0, log
    assert "converted by an earlier run" in log
    rc, ref_log = _finish(reference)
    assert rc == 0, ref_log
    assert "resuming" not in ref_log
    _same_tree(ref, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]  # no folder, no lock
    assert Store(out).verify() == []


def test_killed_source_format_conversion_resumes(tiny, tmp_path):
    """The plain conversion (experts as the checkpoint has them), SIGKILLed while writing
    experts, resumes without rewriting the dense tensors or the blobs already there."""
    src = tiny.checkpoint("qwen3_moe")
    rc, log = _finish(_moetier(str(src), str(tmp_path / "out"), fault="experts:6"))
    assert rc == -signal.SIGKILL, log
    rc, log = _finish(_moetier(str(src), str(tmp_path / "out")))
    assert rc == 0, log
    assert _resumed_counts(log) == (N_DENSE, 6, 0, N_BLOBS - 6)
    convert(src, tmp_path / "ref", progress=False)
    _same_tree(tmp_path / "ref", tmp_path / "out")


def test_other_settings_clear_the_work_folder(tiny, tmp_path, capfd):
    src = tiny.checkpoint("qwen3_moe")
    out = tmp_path / "out"
    work = work_path(out.absolute())
    (work / "store").mkdir(parents=True)
    (work / "settings.json").write_text('{"dense": "written under another --dense"}')
    (work / "journal.jsonl").write_text('{"stage":"aux"}\n{"stage":"dense"}\n')
    (work / "store" / "dense.safetensors").write_bytes(b"stale")
    convert(src, out, progress=False)
    assert "written under other settings, starting afresh" in capfd.readouterr().err
    convert(src, tmp_path / "ref", progress=False)
    _same_tree(tmp_path / "ref", out)
    assert not work.exists()


HOLD = """
import sys
from pathlib import Path
from moetier.quant.work_folder import DestinationLock
with DestinationLock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_convert_into_the_same_destination_is_refused(tiny, tmp_path):
    from moetier.loader.quantize import convert_quantized

    src = tiny.checkpoint("qwen3_moe")
    out = tmp_path / "out"
    work = work_path(out.absolute())
    work.mkdir()
    (work / "settings.json").write_text("{}")  # a live run's folder: left alone
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(LockedError, match=rf"another moetier convert \(PID {holder.pid}\)"):
            convert(src, out, progress=False)
        with pytest.raises(LockedError, match=f"PID {holder.pid}"):  # calibrated: the same lock
            convert_quantized(src, out, calibration=tmp_path / "none.txt", progress=False)
        assert (work / "settings.json").read_text() == "{}"
    finally:
        holder.kill()  # SIGKILL: its lock file stays, but the kernel dropped the lock
        holder.wait()
    assert (tmp_path / ".out.lock").read_text().strip() == str(holder.pid)
    convert(src, out, progress=False)
    assert Store(out).verify() == []
    assert not (tmp_path / ".out.lock").exists() and not work.exists()


def test_dead_processes_folders_are_cleaned(tiny, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f".out.tmp-{dead.pid}"  # the old converter's folder, its process dead
    live = tmp_path / f".out.tmp-{os.getpid()}"
    other = tmp_path / f".other.tmp-{dead.pid}"  # another destination's: not this run's to judge
    for folder in (gone, live, other):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    convert(tiny.checkpoint("qwen3_moe"), tmp_path / "out", progress=False)
    assert not gone.exists()
    assert live.exists() and other.exists()


def test_free_disk_space_is_checked_first(tiny, tmp_path, monkeypatch):
    src = tiny.checkpoint("qwen3_moe")
    real = shutil.disk_usage
    convert(src, tmp_path / "ref", progress=False)
    size = sum(p.stat().st_size for p in (tmp_path / "ref").iterdir())

    def small_disk(path):  # type: ignore[no-untyped-def]
        return real(path)._replace(free=100_000)

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    with pytest.raises(ConvertError, match="not enough free disk space") as err:
        convert(src, tmp_path / "out", progress=False)
    needed = int(re.search(r"needs ([\d,]+) bytes", str(err.value))[1].replace(",", ""))
    assert "100,000 bytes (0.00 GiB) are available" in str(err.value)
    assert size <= needed <= size + 64 * 1024  # an upper estimate of what is written, near it
    assert not (tmp_path / "out").exists() and not work_path((tmp_path / "out").absolute()).exists()

    from moetier.loader.quantize import convert_quantized

    monkeypatch.setattr(shutil, "disk_usage", real)
    convert_quantized(src, tmp_path / "q2s", "q2s", delta="nvfp4", progress=False)
    q2s = (tmp_path / "q2s" / "experts.bin").stat().st_size
    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    with pytest.raises(ConvertError, match="not enough free disk space") as err:
        convert_quantized(src, tmp_path / "out", "q2s", delta="nvfp4", progress=False)
    needed_q = int(re.search(r"needs ([\d,]+) bytes", str(err.value))[1].replace(",", ""))
    assert needed_q == needed + q2s  # the re-encoded experts are written beside the raw ones


def test_checkpoint_without_tokenizer_needs_tokenizer_flag(tiny, tmp_path, capsys):
    from moetier.cli.main import main

    src = tmp_path / "hf"
    shutil.copytree(tiny.checkpoint("qwen3_moe"), src)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (src / name).rename(tokenizer / name)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "has no tokenizer files" in err and "--tokenizer PATH" in err
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(src), str(tmp_path / "out"), "--tokenizer", str(tokenizer)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (tokenizer / name).read_bytes()
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tmp_path / "out").encode("Hello world")
    assert ids == AutoTokenizer.from_pretrained(tiny.checkpoint("qwen3_moe")).encode("Hello world")
    assert main(["convert", str(src), str(tmp_path / "o2"), "--tokenizer", str(tmp_path)]) == 1
    assert "no tokenizer files there" in capsys.readouterr().err


def test_damaged_shard_is_named(tiny, tmp_path, monkeypatch):
    src = tmp_path / "hf"
    shutil.copytree(tiny.checkpoint("qwen3_moe"), src)
    shard = src / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00\xff" * 16  # the JSON header's start overwritten
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ConvertError, match=rf"{re.escape(str(shard))}: unreadable safetensors header.*download"
    ):
        convert(src, tmp_path / "out", progress=False)

    # a read error in the middle of the conversion (the disk fails): the shard is named
    shutil.copyfile(tiny.checkpoint("qwen3_moe") / "model.safetensors", shard)
    real = os.preadv
    calls = []

    def failing(fd, buffers, offset):  # type: ignore[no-untyped-def]
        calls.append(offset)
        if len(calls) > 10:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(
        ConvertError, match=rf"{re.escape(str(shard))}: reading .* failed \(OSError"
    ):
        convert(src, tmp_path / "out", progress=False)
    # the work done before it is kept (hours of it on a large model): the rerun resumes
    assert (work_path(tmp_path / "out") / "store").is_dir()
    monkeypatch.setattr(os, "preadv", real)
    convert(src, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "experts.json").is_file() and not work_path(
        tmp_path / "out"
    ).exists()


def test_fault_hook_costs_nothing_unset():
    assert work_folder._FAULT is None or os.environ.get(FAULT_ENV)
    assert work_folder._parse_fault("experts:3:TERM") == ("experts", 3, signal.SIGTERM)
    assert work_folder._parse_fault("aux") == ("aux", 1, signal.SIGKILL)


def test_full_disk_midway_keeps_the_work_for_a_rerun(tiny, tmp_path, monkeypatch, capfd):
    """A write failing with ENOSPC after four blobs stops the conversion with the work kept; once
    there is room, the same call resumes from the fifth blob."""
    import moetier.quant.convert as convert_module

    src = tiny.checkpoint("qwen3_moe")
    real = convert_module.blob_index_entry
    calls = []

    def full_disk(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "blob_index_entry", full_disk)
    with pytest.raises(OSError, match="No space left"):
        convert(src, tmp_path / "out", progress=False)
    err = capfd.readouterr().err
    assert "stopped by [Errno 28] No space left on device" in err and "run the same command" in err
    assert work_path((tmp_path / "out").absolute()).is_dir() and not (tmp_path / "out").exists()
    monkeypatch.setattr(convert_module, "blob_index_entry", real)
    convert(src, tmp_path / "out", progress=False)
    assert _resumed_counts(capfd.readouterr().err) == (N_DENSE, 4, 0, N_BLOBS - 4)
    convert(src, tmp_path / "ref", progress=False)
    _same_tree(tmp_path / "ref", tmp_path / "out")


def test_calibrated_conversion_checks_free_space(tiny, tmp_path, monkeypatch):
    from tiny_models import TEXT

    from moetier.loader.quantize import convert_quantized

    text = tmp_path / "calib.txt"
    text.write_text(TEXT * 20)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=100_000))
    with pytest.raises(ConvertError, match=r"needs [\d,]+ bytes .* 100,000 bytes .* available"):
        convert_quantized(
            tiny.checkpoint("qwen3_moe"), tmp_path / "out", calibration=text,
            calibration_tokens=512, calibration_mode="diag", progress=False,
        )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]  # nothing left behind


def test_journal_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = work_folder.Journal(path)
    journal.commit({"blob": 0, "crc32": 1})
    journal.commit({"blob": 1, "crc32": 2})
    journal.close()
    with open(path, "ab") as f:
        f.write(b'{"blob": 2, "cr')  # killed mid-line
    again = work_folder.Journal(path)
    assert again.of("blob") == [{"blob": 0, "crc32": 1}, {"blob": 1, "crc32": 2}]
    again.commit({"stage": "experts"})
    again.close()
    assert path.read_text().splitlines()[-1] == '{"stage":"experts"}'
    assert len(path.read_text().splitlines()) == 3
