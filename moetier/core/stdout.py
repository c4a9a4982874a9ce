"""What a command does when the reader of its stdout goes away (`moetier generate ... | head`):
the CLI's main and a spawned rank of `--gpus N` alike."""

from __future__ import annotations

import os
import signal
import sys

STDOUT_CLOSED = 128 + signal.SIGPIPE  # 141: the exit status of a process whose reader left


def stdout_closed() -> int:
    """The reader of stdout went away (`moetier generate ... | head`): stop quietly as a Unix
    tool that SIGPIPE ends does, exit status 128 + SIGPIPE (141). stdout is pointed at
    /dev/null first, so that the interpreter's flush at exit does not fail again (the "Note on
    SIGPIPE" in Python's signal docs; SIGPIPE's default action is not restored, as it asks,
    since it would also end a server whose client goes away)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout with no file descriptor (captured in a test)
        pass
    return STDOUT_CLOSED
