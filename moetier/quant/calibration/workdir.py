"""The resumable work folder of a calibrated conversion (`.{OUT}.calibration` beside OUT).

    settings.json     what the run depends on (source, formats, calibration tokens' digest ...);
                      a folder written under other settings is cleared, not resumed
    store/            the store being built: config, tokenizer, dense.safetensors (dense.json
                      records its index entries once it is complete)
    layers/L.bin      layer L's base blobs back to back (aligned stride), L.delta.bin its delta
                      blobs, L.json its record, written last: the layer's commit
    layers/hidden-L.pt  layer L's output over the calibration batches (the next layer's input)

Every file is written to a temporary name and renamed, so a killed run leaves whole files only;
it resumes after the last committed layer with that layer's outputs, which makes the finished
store byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from moetier.quant.work_folder import open_work_folder, write_text

KILL_ENV = "MOETIER_CALIBRATION_KILL_AFTER"  # test hook: SIGKILL once this many layers committed


class WorkFolder:
    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.layers_dir = path / "layers"
        self.store = path / "store"
        open_work_folder(path, settings)  # cleared where other settings wrote it
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        self.store.mkdir(exist_ok=True)
        self.committed_here = 0

    # --- dense part -------------------------------------------------------------------------
    def dense_index(self) -> dict[str, Any] | None:
        path = self.path / "dense.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def commit_dense(self, dense_tensors: dict[str, Any]) -> None:
        write_text(self.path / "dense.json", json.dumps(dense_tensors, indent=1))

    # --- layers -----------------------------------------------------------------------------
    def committed(self) -> list[int]:
        return sorted(int(p.stem) for p in self.layers_dir.glob("*.json"))

    def record(self, layer: int) -> dict[str, Any]:
        return json.loads((self.layers_dir / f"{layer}.json").read_text())  # type: ignore[no-any-return]

    def blob_file(self, layer: int, plane: str) -> Path:
        return self.layers_dir / (f"{layer}.bin" if plane == "base" else f"{layer}.delta.bin")

    def commit_layer(
        self,
        layer: int,
        record: dict[str, Any],
        blobs: list[torch.Tensor],
        deltas: list[torch.Tensor],
        outputs: list[Any] | None,
    ) -> None:
        """Layer `layer` done: its blobs, its outputs (None: nothing runs after it), then its
        record; the previous layer's outputs are removed once this layer is committed."""
        for plane, items in (("base", blobs), ("delta", deltas)):
            if items:
                tmp = self.blob_file(layer, plane).with_suffix(".tmp")
                with open(tmp, "wb") as f:
                    for blob in items:
                        f.write(blob.numpy().tobytes())
                os.replace(tmp, self.blob_file(layer, plane))
        if outputs is not None:
            tmp = self.layers_dir / f"hidden-{layer}.pt.tmp"
            torch.save(_to_cpu(outputs), tmp)
            os.replace(tmp, self.layers_dir / f"hidden-{layer}.pt")
            record = {**record, "outputs": f"hidden-{layer}.pt"}
        write_text(self.layers_dir / f"{layer}.json", json.dumps(record, indent=1))
        for old in self.layers_dir.glob("hidden-*.pt"):
            if old.name != record.get("outputs"):
                old.unlink()
        self.committed_here += 1
        kill_after = os.environ.get(KILL_ENV)
        if kill_after and self.committed_here >= int(kill_after):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    def outputs(self, layer: int, device: torch.device) -> list[Any]:
        name = self.record(layer).get("outputs")
        if name is None:
            raise ValueError(f"{self.path}: layer {layer} kept no outputs to resume from")
        return _to(torch.load(self.layers_dir / name, weights_only=True), device)

    def remove(self) -> None:
        shutil.rmtree(self.path)


def _to_cpu(value: Any) -> Any:
    return _to(value, torch.device("cpu"))


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value
