"""Sketches of each expert's delta for the gate's `act` term: per (layer, expert) the top-R
right-singular directions of the down projection's delta ΔW_down = W_down(base + delta) −
W_down(base), as rows scaled by their singular values (S [R, I], so ‖S h‖² is the largest part
of ‖ΔW_down h‖²), and optionally the same of the gate_up delta (S_gu [R, H]). The experts op
scores a pair on its base hidden activation h = act(W_gate x, W_up x) as ‖S h‖² (+ ‖S_gu x‖²)
(docs/gate.md, `act`).

A safetensors file beside the store (`gate_act.safetensors`; `act@FILE` names another): tensors
`{layer}.down` [E, R, I] and, with the gate_up sketch, `{layer}.gate_up` [E, R, H], float32;
metadata `kind` ("act"), `rank`, `how`. Written by `moetier quality STORE --write-act-sketch R`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from moetier.kernels.moe_ref import expert_matrix, expert_matrix_with_delta

DEFAULT_FILE = "gate_act.safetensors"
WRITE_COMMAND = "moetier quality STORE --write-act-sketch 16"


def sketch_path(term: str, store: Path) -> Path:
    """The file the `act` term reads: `act@FILE`'s FILE, else the default beside the store."""
    _, _, path = term.partition("@")
    return Path(path) if path else store / DEFAULT_FILE


def top_directions(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """[N, K] -> [rank, K]: the top right-singular vectors scaled by their singular values
    (rows past the matrix's rank are zero), so ‖rows @ h‖² ≤ ‖matrix @ h‖², equal at full rank."""
    _, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    rows = (s[:rank, None] * vh[:rank]).float()
    if rows.shape[0] < rank:
        rows = torch.cat([rows, rows.new_zeros(rank - rows.shape[0], rows.shape[1])])
    return rows


def delta_matrix(store: Any, layer: int, expert: int, name: str) -> torch.Tensor:
    """Matrix `name` of one expert with its delta applied, minus the base's: [N, K] float32."""
    fmt, dfmt = store.blob_format(layer, "base"), store.blob_format(layer, "delta")
    base, delta = store.read_blob(layer, expert, "base"), store.read_blob(layer, expert, "delta")
    return expert_matrix_with_delta(base, fmt, delta, dfmt, name) - expert_matrix(base, fmt, name)


def compute_sketches(
    store: Any,
    rank: int = 16,
    gate_up: bool = False,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> dict[str, torch.Tensor]:
    """Every MoE layer's sketches from the store's delta planes: {"{layer}.down": [E, R, I]}
    (and "{layer}.gate_up": [E, R, H]). An expert without a delta blob gets zeros."""
    if rank < 1:
        raise ValueError(f"the sketch rank must be at least 1, got {rank}")
    if not store.has_plane("delta"):
        raise ValueError(
            f"{store.path} has no delta plane: the act sketches are the delta's singular "
            "directions; convert with --delta nvfp4 (or q2)"
        )
    experts = store.model_config.num_experts
    jobs = [(layer, e) for layer in store.moe_layers for e in range(experts)]
    rows: dict[str, list[torch.Tensor]] = {}
    for layer, e in progress(jobs) if progress is not None else jobs:
        names = ("down", "gate_up") if gate_up else ("down",)
        for name in names:
            if (layer, e, "delta") in store.blobs:
                sketch = top_directions(delta_matrix(store, layer, e, name), rank)
            else:
                cfg = store.model_config
                k = cfg.hidden_size if name == "gate_up" else cfg.expert_intermediate_size
                sketch = torch.zeros(rank, k)
            rows.setdefault(f"{layer}.{name}", []).append(sketch)
    return {key: torch.stack(value).contiguous() for key, value in rows.items()}


def write_sketches(path: Path, tensors: dict[str, torch.Tensor], rank: int, how: str) -> None:
    """Write a sketch file (atomically: temp + rename)."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    meta = {"kind": "act", "rank": str(rank), "how": how}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read_sketches(
    path: Path, device: torch.device | str = "cpu"
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """layer -> (down sketch [E, R, I], gate_up sketch [E, R, H] or None) on `device`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise ValueError(
            f"the gate's act term reads the delta's sketches from {path}, which does not "
            f"exist: write them with `{WRITE_COMMAND}` (or name a file: act@FILE)"
        )
    try:
        tensors = load_file(str(path), device=str(device))
    except (OSError, SafetensorError) as err:
        raise ValueError(f"gate sketch file {path}: {err}") from err
    out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for key, value in tensors.items():
        layer, _, name = key.partition(".")
        if name == "down":
            out[int(layer)] = (value.float(), tensors.get(f"{layer}.gate_up"))
    if not out:
        raise ValueError(f"gate sketch file {path} holds no `{{layer}}.down` sketches")
    return out
