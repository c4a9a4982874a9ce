"""What a user sees (issue #48): `moetier generate` on the demo model, its stderr a terminal (a
pty, so progress bars draw as they would for a person), writes to stderr the load progress bar
and its speed line and nothing else: no warning (FutureWarning, UserWarning, a logged warning, an
unclosed file's ResourceWarning, shown here though Python hides it by default)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
BAR = re.compile(r"^(loading weights|host tier)\b.*(\d+%\||it/s|s/it|\d+/\d+)")
SPEED = re.compile(r"^moetier: \d+ prompt tokens, \d+ new tokens; prefill .* decode .* tok/s$")


def run_with_terminal_stderr(args: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m moetier ARGS` with stderr on a pty."""
    master, slave = pty.openpty()
    # a terminal of 24 rows x 120 columns (a new pty has 0 columns: bars would draw empty)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONWARNINGS")}
    proc = subprocess.Popen(
        [sys.executable, "-W", "default::ResourceWarning", "-m", "moetier", *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    status = proc.wait(timeout=300)
    return status, out, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_generate_writes_only_its_progress_bar_and_speed_line_to_stderr():
    status, out, err = run_with_terminal_stderr(
        ["generate", "--chat", "Tell me about the sea.", "--max-new-tokens", "8"]
    )
    assert status == 0, err
    assert out.strip()
    pieces = [p.strip() for p in re.split(r"[\r\n]+", ANSI.sub("", err)) if p.strip()]
    bars = [p for p in pieces if BAR.match(p)]
    rest = [p for p in pieces if not BAR.match(p)]
    assert bars, f"no load progress bar on a terminal: {pieces}"
    assert len(rest) == 1 and SPEED.match(rest[0]), rest
