"""What makes a conversion survive faults: the destination's lock, a work folder that a rerun of
the same command resumes, its journal of committed pieces, and the test hook that kills a run.

- `DestinationLock`: `.{OUT}.lock` beside the destination, flock'ed while a conversion writes
  `OUT` and holding its PID, so a second conversion into `OUT` is refused while the first lives;
  the kernel drops the lock of a dead process (SIGKILL included), so a stale file never blocks.
  Re-entrant within one process. Being the first thing written, it is where a folder that
  cannot be written is refused (UnwritableError).
- `open_work_folder(path, settings)`: a work folder written under other settings is cleared, not
  resumed (and says so); `settings.json` records what the run depends on.
- `Journal`: an append-only file of JSON lines, one per committed piece (a tensor or blob written
  and flushed, with its crc32); a torn last line is dropped. A resumed writer re-reads what the
  journal claims and keeps the pieces whose crc32 still matches, then truncates after them.
- `say_stopped(err, work)`: the one line that says why a conversion stopped and that the same
  command resumes the work kept in `work`; the command line adds nothing to it.
- `fault(point)`: the test hook. `MOETIER_FAULT_AT=POINT:N[:SIGNAL]` makes the process send itself
  SIGNAL (KILL, TERM or INT; default KILL) the N-th time it passes POINT; unset, it costs one
  global lookup. The points are named where `fault` is called (quant/convert.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAULT_ENV = "MOETIER_FAULT_AT"
SETTINGS_FILE = "settings.json"


class LockedError(ValueError):
    """Another live process is converting into the same destination."""


class UnwritableError(ValueError):
    """The destination's folder cannot be created or written (permissions, a read-only file
    system): said before anything is written."""


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.lock"


class DestinationLock:
    """An exclusive flock on `.{dst}.lock` while converting into `dst`; the file holds the PID.

    The file is removed on release; a process that opened it before the removal finds, once it
    holds the flock, that the path names another file (or none) and tries again."""

    _held: dict[Path, tuple[int, int]] = {}  # lock path -> (fd, depth), this process's locks

    def __init__(self, dst: Path) -> None:
        self.path = lock_path(Path(dst).absolute())

    def __enter__(self) -> DestinationLock:
        held = self._held.get(self.path)
        if held is not None:
            self._held[self.path] = (held[0], held[1] + 1)
            return self
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            file = next((p for p in (folder, *folder.parents) if p.is_file()), None)
            why = f"{file} is a file" if file else err.strerror
            raise UnwritableError(
                f"cannot create the folder {folder} ({why}): nothing was written; choose an "
                "output folder you can write to"
            ) from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise UnwritableError(
                    f"cannot write in {folder} ({err.strerror}): nothing was written; choose "
                    "an output folder you can write to"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise LockedError(
                    f"another moetier convert (PID {_read_pid(self.path)}) is writing "
                    f"{self.path.parent / self.path.name[1:-5]} now: wait for it to finish, "
                    "or stop it and run this command again to resume its work"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # released and removed by its holder meanwhile: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._held[self.path] = (fd, 1)
        return self

    def __exit__(self, *exc: object) -> None:
        fd, depth = self._held[self.path]
        if depth > 1:
            self._held[self.path] = (fd, depth - 1)
            return
        del self._held[self.path]
        self.path.unlink(missing_ok=True)
        os.close(fd)


def _read_pid(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


LEGACY_TMP = re.compile(r"\.(.+)\.tmp-(\d+)")


def clean_dead_folders(dst: Path) -> list[Path]:
    """Remove `.{dst}.tmp-PID` folders (the old converter's, keyed by PID) whose process is
    dead; a live process's folder is left alone. Returns what was removed."""
    removed = []
    for path in dst.parent.glob(f".{glob_escape(dst.name)}.tmp-*"):
        match = LEGACY_TMP.fullmatch(path.name)
        if match is None or match.group(1) != dst.name or not path.is_dir():
            continue
        if not pid_alive(int(match.group(2))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def open_work_folder(path: Path, settings: dict[str, Any], log: bool = True) -> bool:
    """Make `path` a work folder for `settings`; True when it already held work for them (to
    resume), False when it is new or was cleared because other settings wrote it."""
    settings = json.loads(json.dumps(settings))  # as read back: tuples become lists
    settings_file = path / SETTINGS_FILE
    resumed = False
    if path.exists():
        try:
            old = json.loads(settings_file.read_text())
        except (OSError, ValueError):
            old = None
        if old == settings:
            resumed = True
        else:
            if log:
                say(f"{path}: written under other settings, starting afresh")
            shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    if not resumed:
        write_text(settings_file, json.dumps(settings, indent=1, sort_keys=True))
    return resumed


class Journal:
    """Committed pieces of a work folder, one JSON line each, appended after the piece's bytes
    are written and flushed to the operating system (a process's death loses nothing flushed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        good = 0
        if path.exists():
            data = path.read_bytes()
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break  # torn by a kill mid-write
                try:
                    self.records.append(json.loads(line))
                except ValueError:
                    break
                good += len(line)
        self.file = open(path, "ab")  # noqa: SIM115 - closed in close()
        self.file.truncate(good)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if kind in r]

    def has_stage(self, stage: str) -> bool:
        return any(r.get("stage") == stage for r in self.records)

    def commit(self, record: dict[str, Any]) -> None:
        self.file.write((json.dumps(record, separators=(",", ":")) + "\n").encode())
        self.file.flush()
        self.records.append(record)

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Keep only `records` (pieces found bad on resume are dropped with what follows)."""
        self.file.close()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        os.replace(tmp, self.path)
        self.records = list(records)
        self.file = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def close(self) -> None:
        self.file.close()


def write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (temporary name, then rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def say(message: str) -> None:
    print(f"moetier convert: {message}", file=sys.stderr, flush=True)


STOP_SAID = "moetier_stop_said"  # set on an exception whose stop was said (say_stopped)


def say_stopped(err: BaseException, work: Path) -> None:
    """Say why the conversion stopped (`err`: a signal, KeyboardInterrupt("SIGTERM") from
    the command line's handler, or an OSError) and that the same command resumes the work in
    `work`; `err` is marked (STOP_SAID) so that the command line says it only once."""
    if isinstance(err, KeyboardInterrupt):
        why = f"stopped by {err.args[0]}" if err.args else "interrupted"
    else:
        why = f"stopped by {err}"
    say(
        f"{why}; the work done so far is kept in {work}: run the same command again to resume "
        "it (or delete that folder to start afresh)"
    )
    setattr(err, STOP_SAID, True)


@contextlib.contextmanager
def said_when_stopped(work: Path) -> Iterator[None]:
    """say_stopped for a KeyboardInterrupt or OSError that stops the work kept in `work`; the
    exception goes on up."""
    try:
        yield
    except (KeyboardInterrupt, OSError) as err:
        say_stopped(err, work)
        raise


# --- the fault hook (tests) ------------------------------------------------------------------
def _parse_fault(text: str | None) -> tuple[str, int, int] | None:
    if not text:
        return None
    point, _, rest = text.partition(":")
    count, _, sig = rest.partition(":")
    return point, int(count or 1), getattr(signal, f"SIG{sig or 'KILL'}")


_FAULT = _parse_fault(os.environ.get(FAULT_ENV))
_passes: dict[str, int] = {}


def fault(point: str, count: int | None = None) -> None:
    """Test hook: the process signals itself here when MOETIER_FAULT_AT names this point and
    count (`count` given: the caller's own count, e.g. pieces committed in all runs; else the
    passes of this process)."""
    if _FAULT is None or _FAULT[0] != point:
        return
    if count is None:
        count = _passes[point] = _passes.get(point, 0) + 1
    if count == _FAULT[1]:
        os.kill(os.getpid(), _FAULT[2])
