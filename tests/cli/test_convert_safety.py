"""`moetier convert` never deletes what it did not write (`--force` replaces only a moetier store
or an empty folder, never the checkpoint or a folder holding it), and its errors say what is
wrong, naming the file, in one line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moetier.cli.main import main
from moetier.quant import convert as convert_module
from moetier.quant.convert import convert, work_path
from moetier.quant.sources import ConvertError
from moetier.quant.store import Store
from moetier.quant.work_folder import FAULT_ENV


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones included) -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run `moetier convert ARGS`, which must fail with one error line; returns that line."""
    assert main(["convert", *args]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetier convert: error: "), err
    return lines[0]


@pytest.fixture
def ckpt(tiny, tmp_path: Path) -> Path:
    """A copy of the tiny Qwen3-MoE checkpoint, for tests that aim conversions at it."""
    path = tmp_path / "ckpt" / "qwen3"
    shutil.copytree(tiny.checkpoint("qwen3_moe"), path)
    return path


def test_the_checkpoint_folder_itself_is_refused(ckpt, capsys):
    before = _tree(ckpt.parent)
    for force in ([], ["--force"]):
        line = _refused(capsys, str(ckpt), str(ckpt), *force)
        assert "is the checkpoint folder being converted" in line
        assert f"e.g. {ckpt.parent / 'qwen3-moetier'}" in line
    assert _tree(ckpt.parent) == before  # no lock, no work folder, the checkpoint whole


def test_a_folder_holding_the_checkpoint_is_refused(ckpt, tmp_path, capsys):
    """`convert victim/inner/qwen3 victim --force` deleted victim, the checkpoint inside it and
    the user's file beside."""
    victim = tmp_path / "victim"
    shutil.copytree(ckpt, victim / "inner" / "qwen3")
    (victim / "user.txt").write_text("mine")
    before = _tree(tmp_path)
    line = _refused(capsys, str(victim / "inner" / "qwen3"), str(victim), "--force")
    assert f"{victim} holds the checkpoint being converted" in line
    assert _tree(tmp_path) == before


def test_a_hub_snapshots_blobs_are_refused(ckpt, tmp_path, capsys):
    """A Hub snapshot's files are links into the cache's blobs/: that folder holds the
    checkpoint too, though the snapshot folder is elsewhere."""
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in ckpt.iterdir():
        shutil.copyfile(path, blobs / f"blob-{path.name}")
        (snapshot / path.name).symlink_to(blobs / f"blob-{path.name}")
    before = _tree(blobs)
    line = _refused(capsys, str(snapshot), str(blobs), "--force")
    assert "holds the checkpoint being converted" in line
    assert _tree(blobs) == before


def test_the_current_folder_with_user_files_is_refused(ckpt, tmp_path, capsys, monkeypatch):
    """`cd work && moetier convert ../ckpt/qwen3 . --force` emptied the user's folder."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    (work / "results").mkdir()
    monkeypatch.chdir(work)
    line = _refused(capsys, str(ckpt), ".", "--force")
    assert "is not a moetier store: it holds notes.txt, results/" in line
    assert "Choose another output folder, or remove it yourself" in line
    assert (work / "notes.txt").read_text() == "mine" and (work / "results").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "work"]


def test_a_file_is_refused_up_front(ckpt, tmp_path, capsys):
    """OUT a regular file: --force failed after converting ('Not a directory ... run the same
    command again to resume', which could never succeed) and left .OUT.convert/ behind."""
    out = tmp_path / "afile"
    out.write_text("data")
    for force in ([], ["--force"]):
        line = _refused(capsys, str(ckpt), str(out), *force)
        assert f"{out} is a file, not a folder" in line
    assert out.read_text() == "data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ckpt"]


def test_force_replaces_a_store_or_an_empty_folder(tiny, ckpt, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    line = _refused(capsys, str(ckpt), str(store))
    assert "already exists" in line and "--force" in line
    (store / "gate_hot.json").write_text("{}")  # a table a later verb wrote beside: a store's
    assert main(["convert", str(ckpt), str(store), "--force"]) == 0
    assert Store(store).verify() == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", str(ckpt), str(empty), "--force"]) == 0
    assert Store(empty).verify() == []
    (store / "README.md").write_text("my notes")  # no longer a store's files alone
    line = _refused(capsys, str(ckpt), str(store), "--force")
    assert "is not a moetier store: it holds README.md" in line
    assert (store / "README.md").read_text() == "my notes"


def test_the_calibrated_conversion_checks_the_same(ckpt, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("hello world " * 400)
    before = _tree(ckpt.parent)
    flags = ["--experts", "q2s", "--calibration", str(text), "--force"]
    line = _refused(capsys, str(ckpt), str(ckpt), *flags)
    assert "is the checkpoint folder being converted" in line
    line = _refused(capsys, str(ckpt), str(ckpt.parent), *flags)
    assert "holds the checkpoint being converted" in line
    assert _tree(ckpt.parent) == before


def test_files_put_in_the_destination_meanwhile_are_kept(ckpt, tmp_path, monkeypatch):
    """A user file that appears in OUT while the conversion runs is not removed at publish: the
    finished store stays in the work folder, and the same command publishes it once OUT holds
    only a store's files again."""
    from moetier.quant.convert import DestinationChanged

    out = tmp_path / "out"
    out.mkdir()
    real = convert_module._build

    def build_then_user_writes(*args, **kwargs):  # type: ignore[no-untyped-def]
        real(*args, **kwargs)
        (out / "user.txt").write_text("mine")

    monkeypatch.setattr(convert_module, "_build", build_then_user_writes)
    with pytest.raises(DestinationChanged, match="put there while the conversion ran"):
        convert(ckpt, out, force=True, progress=False)
    assert (out / "user.txt").read_text() == "mine"
    assert (work_path(out) / "store" / "experts.json").is_file()
    monkeypatch.setattr(convert_module, "_build", real)
    (out / "user.txt").unlink()
    convert(ckpt, out, force=True, progress=False)
    assert Store(out).verify() == [] and not work_path(out).exists()


def test_an_unwritable_folder_is_named(ckpt, tmp_path, capsys, monkeypatch):
    """`convert ckpt /sys/foo` said "Permission denied: '/sys/.foo.lock'; what is written is
    kept: run the same command again to resume" though nothing was written."""
    (tmp_path / "afile").write_text("data")
    line = _refused(capsys, str(ckpt), str(tmp_path / "afile" / "sub" / "out"))
    assert f"cannot create the folder {tmp_path / 'afile' / 'sub'}" in line
    assert f"{tmp_path / 'afile'} is a file" in line and "nothing was written" in line
    real = os.open

    def read_only(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    line = _refused(capsys, str(ckpt), str(tmp_path / "ro" / "out"))
    assert f"cannot write in {tmp_path / 'ro'} (Permission denied): nothing was written" in line
    assert "resume" not in line


def test_a_store_as_the_source_is_named(tiny, tmp_path, capsys):
    line = _refused(capsys, str(tiny.store("qwen3_moe")), str(tmp_path / "out"))
    assert "is already a moetier store (experts.json is there)" in line
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_given_as_a_store_is_told_to_convert_elsewhere(ckpt, capsys):
    """The hint of the verbs that read a store used to be `moetier convert HF_DIR <that very
    folder>`, steering the conversion into the checkpoint."""
    with pytest.raises(ValueError) as err:
        Store.check_path(ckpt)
    assert f"moetier convert {ckpt} {ckpt.parent / 'qwen3-moetier'}" in str(err.value)
    assert main(["plan", str(ckpt), "--gpu-memory", "1GiB"]) == 1
    assert f"moetier convert {ckpt} {ckpt.parent / 'qwen3-moetier'}" in capsys.readouterr().err


def test_nested_with_another_delta_says_what_is_wrong(ckpt, tmp_path, capsys):
    """It said 'choose nvfp4 or q2' to a user who had chosen nvfp4, after converting."""
    line = _refused(
        capsys, str(ckpt), str(tmp_path / "out"), "--experts", "nested", "--delta", "nvfp4"
    )
    assert "--delta nvfp4 does not apply to --experts nested" in line
    assert "choose nvfp4 or q2" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # refused before converting


@pytest.mark.parametrize("tokens", ["0", "-5", "many"])
def test_calibration_tokens_are_checked_when_parsed(ckpt, tmp_path, capsys, tokens):
    """0 said 'calibration text has 0 tokens'; -5 crashed with shape '[-1, 512]' is invalid."""
    text = tmp_path / "calib.txt"
    text.write_text("hello world " * 400)
    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(ckpt), str(tmp_path / "out"), "--experts", "q2s",
              "--calibration", str(text), f"--calibration-tokens={tokens}"])  # fmt: skip
    assert exit_.value.code == 2
    assert f"--calibration-tokens: '{tokens}': a whole number, 1 or more" in capsys.readouterr().err


def test_calibration_tokens_below_one_sequence_are_named(ckpt, tmp_path, capsys):
    """100 tokens said 'calibration text has 100 tokens, fewer than one chunk of 512' of a
    text far longer: the flag is what is short."""
    text = tmp_path / "calib.txt"
    text.write_text("hello world " * 400)
    line = _refused(capsys, str(ckpt), str(tmp_path / "out"), "--experts", "q2s",
                    "--calibration", str(text), "--calibration-tokens", "100")  # fmt: skip
    assert "--calibration-tokens 100 is less than one calibration sequence of 512" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "ckpt"]


def test_calibration_refine_is_checked_when_parsed(ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["convert", str(ckpt), str(tmp_path / "out"), "--calibration-refine=-1"])
    assert "--calibration-refine: '-1': a whole number, 0 or more" in capsys.readouterr().err


def test_damaged_input_files_are_named(ckpt, tiny, tmp_path, capsys):
    text = tmp_path / "calib.bin.txt"
    text.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)  # gzip, not text
    line = _refused(
        capsys, str(ckpt), str(tmp_path / "o1"), "--experts", "q2s", "--calibration", str(text)
    )
    assert f"calibration file {text} is not UTF-8 text" in line
    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    (store / "experts.json").write_text('{"version": 1,')
    with pytest.raises(ValueError, match=f"{store / 'experts.json'} cannot be read as JSON"):
        Store(store)
    (ckpt / "config.json").write_text('{"model_type": "qwen3_moe",')
    line = _refused(capsys, str(ckpt), str(tmp_path / "o2"))
    assert f"{ckpt / 'config.json'} cannot be read as JSON" in line
    line = _refused(capsys, str(ckpt), str(tmp_path / "o3"), "--experts", "q2s")
    assert f"{ckpt / 'config.json'} cannot be read as JSON" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.bin.txt", "ckpt", "store"]


def test_a_stopped_conversion_says_so_once(tiny, tmp_path):
    """Stopped by a signal, it printed two lines saying the same thing; once, naming the work
    folder to resume from."""
    env = {**os.environ, FAULT_ENV: "experts:3:INT"}
    done = subprocess.run(
        [sys.executable, "-m", "moetier", "convert", str(tiny.checkpoint("qwen3_moe")),
         str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    lines = [x for x in done.stderr.splitlines() if "run the same command again" in x]
    assert lines == [
        f"moetier convert: stopped by SIGINT; the work done so far is kept in "
        f"{tmp_path / '.out.convert'}: run the same command again to resume it (or delete that "
        "folder to start afresh)"
    ]


def test_a_stopped_calibrated_conversion_says_so_once(ckpt, tmp_path, capsys, monkeypatch):
    from moetier.quant.calibration import sequential

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGTERM)  # the command's handler raises KeyboardInterrupt

    monkeypatch.setattr(sequential, "_run_layers", interrupted)
    text = tmp_path / "calib.txt"
    text.write_text("hello world " * 400)
    code = main(["convert", str(ckpt), str(tmp_path / "out"), "--experts", "q2s",
                 "--calibration", str(text), "--calibration-tokens", "512",
                 "--calibration-mode", "diag"])  # fmt: skip
    assert code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "run the same command again" in x]
    assert len(lines) == 1, err
    work = tmp_path / ".out.calibration"
    assert f"stopped by SIGTERM; the work done so far is kept in {work}" in lines[0]


def test_destination_check_without_the_command_line(ckpt, tmp_path):
    """The library call refuses the same (hub.converted and scripts call it directly)."""
    with pytest.raises(ConvertError, match="is the checkpoint folder being converted"):
        convert(ckpt, ckpt, force=True, progress=False)
    assert (ckpt / "model.safetensors").is_file()
