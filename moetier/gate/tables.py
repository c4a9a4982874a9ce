"""Per-(layer, expert) tables the gate's `sensitivity` and `hot` terms read: a small JSON file
beside the store (`gate_sensitivity.json`, `gate_hot.json` by default; `term@FILE` names another).

Format: {"kind": ..., "layers": {"<layer>": [E floats]}, "how": "<what measured it>"}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

DEFAULT_FILES = {"sensitivity": "gate_sensitivity.json", "hot": "gate_hot.json"}


def table_path(term: str, store: Path) -> Path:
    """The file a table term reads: `name@FILE`'s FILE, else the default beside the store."""
    name, _, path = term.partition("@")
    return Path(path) if path else store / DEFAULT_FILES[name]


def write_table(path: Path, kind: str, layers: dict[int, list[float]], how: str) -> None:
    """Write a table file (atomically: temp + rename)."""
    body: dict[str, Any] = {
        "kind": kind,
        "how": how,
        "layers": {str(k): v for k, v in layers.items()},
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)


def read_table(path: Path, device: torch.device | str = "cpu") -> dict[int, torch.Tensor]:
    """layer -> [E] float32 tensor on `device`."""
    try:
        body = json.loads(Path(path).read_text())
        return {
            int(layer): torch.tensor(row, dtype=torch.float32, device=device)
            for layer, row in body["layers"].items()
        }
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"gate table {path}: {err}") from err


def hot_set(expert_ids: torch.Tensor, num_experts: int, fraction: float) -> dict[int, list[float]]:
    """The static hot set of a routing trace (`expert_ids` [layers, tokens, k]): per layer the
    most used experts, added in order of use while each brings their share of the layer's
    pairs closer to `fraction` (1.0 in the table: in the set, else 0.0)."""
    out: dict[int, list[float]] = {}
    for layer in range(expert_ids.shape[0]):
        counts = torch.bincount(expert_ids[layer].flatten().long(), minlength=num_experts)
        order = torch.argsort(counts, descending=True, stable=True)
        share = torch.cumsum(counts[order].double(), 0) / counts.sum()
        row = [0.0] * num_experts
        held = 0.0
        for e, s in zip(order.tolist(), share.tolist(), strict=True):
            if abs(s - fraction) >= abs(held - fraction) - 1e-12:
                break
            row[e], held = 1.0, s
        out[layer] = row
    return out
