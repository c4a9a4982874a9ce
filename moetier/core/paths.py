"""moetier's cache folder, shared by everything it keeps between runs: converted Hub stores
(`stores/`, cli/hub.py), tuned kernel tables (`kernels/`), torch.compile's artefacts
(`inductor/`) and the CPU expert kernel's build (`cpu/`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$MOETIER_CACHE, else $XDG_CACHE_HOME/moetier, else ~/.cache/moetier."""
    if os.environ.get("MOETIER_CACHE"):
        return Path(os.environ["MOETIER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetier"
