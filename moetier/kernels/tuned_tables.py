"""The tuned kernel tables a card reads (docs/kernels.md, "Tuning"): the user's own, written by
`moetier tune` into the cache folder under a name of card, driver and Triton version (a new
driver or Triton compiles other code, so its table starts again); the shipped ones in
`moe_dispatch.CONFIG_DIR` (`configs/<card>.json`). `moe_dispatch.tuned_configs` layers them:
the user's entries over the card's shipped table, or over the table of a shipped card of the
same architecture.

A table is {"<kind>:<n>x<k>[:<bucket>]": KernelChoice fields}; keys starting with "_" are notes
(`_about`: who wrote it, when), not entries."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from moetier.core.paths import cache_root

# a table file that replaces every lookup ("defaults": none, the generic defaults), e.g. to time
# one table against another in separate processes (bench/tune.py)
TABLE_ENV = "MOETIER_KERNEL_CONFIGS"

Table = dict[str, dict[str, Any]]


def driver_version() -> str:
    """The NVIDIA driver's version (e.g. 570.86.15), else the CUDA driver API's (cuda12080),
    else "none" (no CUDA)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    import torch

    if not torch.cuda.is_available():
        return "none"
    try:
        return f"cuda{torch._C._cuda_getDriverVersion()}"  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return "unknown"


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


def table_name(card: str, driver: str, triton: str) -> str:
    """The user table's file name: card name (spaces as _), driver and Triton version."""
    clean = [re.sub(r"[^A-Za-z0-9._+-]", "_", part) for part in (card, driver, triton)]
    return "{}__driver-{}__triton-{}.json".format(*clean)


def user_table_path(card: str, driver: str | None = None, triton: str | None = None) -> Path:
    """Where `moetier tune` keeps this card's table (this driver and Triton unless given)."""
    driver = driver_version() if driver is None else driver
    triton = triton_version() if triton is None else triton
    return cache_root() / "kernels" / table_name(card, driver, triton)


def read_table(path: Path, known: Collection[str] | None = None) -> Table:
    """A table file's entries (its notes left out). A file that is not a table of objects, or
    (given `known`, the KernelChoice fields: moe_dispatch reads them so) has an entry with other
    fields (hand-edited, cut short, or written by a moetier with other fields) is a ValueError
    naming it and what to do, at start-up rather than at the first kernel call."""
    redo = f"delete {path} (or run `moetier tune` again, which rewrites it)"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"kernel config table {path} cannot be read ({err}): {redo}") from None
    if not isinstance(data, dict):
        raise ValueError(f"kernel config table {path} is not a JSON object: {redo}")
    table: Table = {}
    for key, value in data.items():
        if key.startswith("_"):
            continue
        if not isinstance(value, dict):
            unknown = ["(not an object)"]
        else:
            unknown = sorted(set(value) - set(known)) if known is not None else []
        if unknown:
            raise ValueError(
                f"kernel config table {path}: entry {key!r} has fields this moetier does not "
                f"know ({', '.join(unknown)}): {redo}"
            )
        table[key] = value
    return table


def layered(user: Table, base: Table) -> Table:
    """The user's entries over `base`'s: an entry of the same key replaced. The dispatcher takes
    a `<key>:p<P>` entry for calls of at most P pairs before the entry without a size, and
    `moetier tune` writes one per decode size it timed, so each replaces its own."""
    return {**base, **user}


def write_user_table(path: Path, entries: Table, about: dict[str, Any]) -> Table:
    """Merges `entries` into the table at `path` (a tune of another store keeps the first's
    entries), notes `about` (card, versions, when), writes it atomically; -> the entries now."""
    old = read_table(path) if path.exists() else {}
    merged = {**old, **entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"_about": about, **dict(sorted(merged.items()))}, indent=1) + "\n")
    tmp.replace(path)
    return merged
