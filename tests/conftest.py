from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import MODEL_TYPES, build_tiny  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
EVAL_MODEL = Path(os.environ.get("MOETIER_EVAL_MODEL", SHARED / "models" / "eval-moe-70m"))

# Without a GPU, Triton kernels run (slowly, on small shapes) in Triton's interpreter. Read when
# a kernel is defined, so it must be set before moetier.kernels' Triton modules are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class TinyModels:
    """Builds each tiny checkpoint (and its converted store) once per test session."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def checkpoint(self, model_type: str, fused: bool = False) -> Path:
        path = self.root / "hf" / (model_type + ("-fused" if fused else ""))
        if not (path / "config.json").exists():
            build_tiny(model_type, path, fused=fused)
        return path

    def store(self, model_type: str, fused: bool = False) -> Path:
        from moetier.quant.convert import convert

        path = self.root / "stores" / (model_type + ("-fused" if fused else ""))
        if not (path / "experts.json").exists():
            convert(self.checkpoint(model_type, fused), path, progress=False)
        return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session", params=MODEL_TYPES)
def model_type(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def eval_model() -> Path:
    if not (EVAL_MODEL / "config.json").exists():
        pytest.fail(f"eval model not found at {EVAL_MODEL} (set MOETIER_EVAL_MODEL)")
    return EVAL_MODEL
