"""bench/guess_precision.py scores guesses as zero-copy staging does (the runtime's scaled
routers on the MoE input or on the residual after the layer) and counts them right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moetier.config import EngineConfig
from moetier.loader.load import load_model
from moetier.models.experts import router_weights

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import guess_precision  # noqa: E402


@pytest.mark.parametrize("source", ["input", "output"])
def test_bench_scores_are_the_runtimes(tiny, source):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    model, runtime = loaded.model, loaded.runtime
    ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
    moe, seen = guess_precision.capture(model, ids)
    routers, norms = router_weights(model, sorted(runtime.formats))
    runtime.enable_prefetch(routers, norms, guess_from=source)
    for a, b in zip(moe, moe[1:], strict=False):
        x = seen[a]["h"] if source == "input" else seen[a]["r"] + seen[a]["moe"]
        want = x @ runtime._scaled_routers[a].float().T  # what staging scores with
        got = guess_precision.guess_scores(model, seen, a, b)[source]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_precision_counts_right_guesses(tiny):
    """With no expert cached and m = E, every true top-k expert is among the guesses: precision
    is k / E for both sources."""
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    cfg = loaded.model_config
    ids = torch.tensor([[5, 17, 33]])
    found = guess_precision.precision(loaded.model, ids, 0.0, [cfg.num_experts], seed=0)
    for source in ("input", "output"):
        right, total = found[(source, cfg.num_experts)]
        pairs = len(loaded.runtime.formats) - 1  # consecutive MoE layer pairs
        assert total == pairs * 3 * cfg.num_experts and right == pairs * 3 * cfg.top_k
