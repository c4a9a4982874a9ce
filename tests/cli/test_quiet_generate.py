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


SERVE_LINES = re.compile(
    r"^(serving \S+ on http://\S+ \(loading\)"  # moetier's first line
    r"|INFO: +(Started server process|Waiting for (application|background)|Application (startup|"
    r"shutdown)|Uvicorn running|Shutting down|Finished server process|127\.0\.0\.1:\d+ - \"GET ).*"
    r"|INFO moetier\.\S+: .*)$"  # moetier's own info lines (the parser it chose, say)
)


@pytest.mark.slow
def test_serve_at_its_default_level_writes_no_library_info():
    """`moetier serve` logs at info by default (its own and uvicorn's lines); transformers' and
    huggingface_hub's info (a config dump on every load) stays out unless --log-level asks."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY")
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier", "serve", "--device", "cpu", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError("the server did not become ready")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    unexpected = [line for line in lines if not SERVE_LINES.match(line)]
    assert lines and not unexpected, unexpected
