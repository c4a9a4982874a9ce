"""How well zero-copy staging's guesses of the next MoE layer's experts hit (CPU or GPU).

For every token of one forward pass and every pair of consecutive MoE layers (L, N), the m best
experts of N off a random `--cached` share of the experts (the cached slots staging skips) are
guessed two ways, as `ExpertsRuntime.enable_prefetch(..., guess_from=...)` does:

  input   N's router on L's MoE input scaled by the norm ratio w_N / w_L (the scores can be
          computed beside L's experts kernel)
  output  N's router, columns scaled by w_N, on the residual after L (only N's attention is
          missing; the scores wait for L's kernel)

and scored against N's true top-k. One JSON line per (source, m): precision = guessed experts
that N then routes to / guesses.

  M=../shared/models/eval-moe-70m   # a store of it: moetier convert $M /tmp/eval-q2s ...
  python bench/guess_precision.py --store /tmp/eval-q2s --heldout $M/heldout_tokens.npz
  python bench/guess_precision.py --synthetic-layers 8    # the random-weight Qwen3 slice

The store is a native one (qwen3_moe, deepseek_v3); `--synthetic-layers` writes the slice
bench/decode.py --tiered decodes (write_synthetic_store) under --tmp first. bench/predict.py
scores the HF eval-moe-70m's guesses from layer outputs and inputs without a cache (its
section of docs/residency.md); this one scores staging's own two sources, cache excluded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.loader.load import load_model
from moetier.quant.synthetic import QWEN3_30B_A3B, write_synthetic_store

sys.path.insert(0, str(Path(__file__).parent))
from common import emit  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402


def capture(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[int], dict[int, Any]]:
    """One forward over ids [1, T]: per MoE layer its MoE input h, the residual r before its MoE
    and its MoE output (each [T, H], float32)."""
    layers = model.model.layers
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate")]
    seen: dict[int, dict[str, torch.Tensor]] = {i: {} for i in moe}
    handles = []
    for i in moe:

        def before(mod: Any, args: Any, i: int = i) -> None:
            seen[i]["h"] = args[0].reshape(-1, args[0].shape[-1]).float()

        def after(mod: Any, args: Any, out: torch.Tensor, i: int = i) -> None:
            seen[i]["moe"] = out.reshape(-1, out.shape[-1]).float()

        def residual(mod: Any, args: Any, i: int = i) -> None:
            seen[i]["r"] = args[0].reshape(-1, args[0].shape[-1]).float()

        handles += [
            layers[i].mlp.register_forward_pre_hook(before),
            layers[i].mlp.register_forward_hook(after),
            layers[i].post_attention_layernorm.register_forward_pre_hook(residual),
        ]
    cache = model.new_cache(1, ids.shape[1], torch.float32, ids.device)
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[1], device=ids.device)[None], cache)
    for h in handles:
        h.remove()
    return moe, seen


def guess_scores(
    model: torch.nn.Module, seen: dict[int, Any], a: int, b: int
) -> dict[str, torch.Tensor]:
    """Layer b's scores [T, E] of its experts guessed from MoE layer a, per source."""
    layers = model.model.layers
    router = layers[b].mlp.gate.weight.float()
    w_a = layers[a].post_attention_layernorm.weight.float()
    w_b = layers[b].post_attention_layernorm.weight.float()
    ratio = torch.where(w_a != 0, w_b / torch.where(w_a != 0, w_a, 1), 0)
    return {
        "input": (seen[a]["h"] * ratio) @ router.T,
        "output": ((seen[a]["r"] + seen[a]["moe"]) * w_b) @ router.T,
    }


def precision(
    model: torch.nn.Module, ids: torch.Tensor, cached: float, ms: list[int], seed: int
) -> dict[tuple[str, int], tuple[int, int]]:
    """{(source, m): (right guesses, guesses)} over every token and MoE layer pair."""
    moe, seen = capture(model, ids)
    layers = model.model.layers
    gen = torch.Generator().manual_seed(seed)
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for a, b in zip(moe, moe[1:], strict=False):
        router = layers[b].mlp.gate.weight.float()
        experts, k = router.shape[0], layers[b].mlp.gate.top_k
        actual = (seen[b]["h"] @ router.T).topk(k, dim=1).indices  # [T, k]
        scores = guess_scores(model, seen, a, b)
        for t in range(ids.shape[1]):
            off = torch.ones(experts, dtype=torch.bool)
            off[torch.randperm(experts, generator=gen)[: round(cached * experts)]] = False
            truth = set(actual[t].tolist())
            for source, s in scores.items():
                order = [e for e in s[t].argsort(descending=True).tolist() if off[e]]
                for m in ms:
                    right = sum(e in truth for e in order[:m])
                    done = out.get((source, m), (0, 0))
                    out[(source, m)] = (done[0] + right, done[1] + m)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, help="a native moetier store")
    parser.add_argument("--synthetic-layers", type=int, default=0)
    parser.add_argument("--heldout", type=Path, help="token ids (.npz, key `tokens`)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens in the forward pass")
    parser.add_argument("--cached", type=float, default=0.25, help="share of experts cached")
    parser.add_argument("--m", default="1,2,4", help="guesses per layer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    if (args.store is None) == (args.synthetic_layers == 0):
        parser.error("give --store or --synthetic-layers")
    path = args.store
    if args.synthetic_layers:
        shape = dict(QWEN3_30B_A3B, num_hidden_layers=args.synthetic_layers)
        dst = args.tmp / f"moetier-guess-qwen3-{args.synthetic_layers}"
        path = write_synthetic_store(dst, shape, "q2s", DEFAULT_STORE)
    loaded = load_model(path, EngineConfig(device=args.device, dtype="float32", native=True))
    vocab = loaded.model_config.vocab_size
    if args.heldout:
        tokens = np.load(args.heldout)["tokens"][: args.tokens].astype(np.int64)
        ids = torch.from_numpy(tokens)[None]
    else:
        ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    ms = [int(m) for m in args.m.split(",")]
    info = run_info()
    for (source, m), (right, total) in sorted(
        precision(loaded.model, ids, args.cached, ms, 0).items()
    ):
        emit({**info, "case": "guess-precision", "store": str(args.store or "synthetic"),
              "layers": loaded.model_config.num_layers, "tokens": ids.shape[1],
              "cached": args.cached, "source": source, "m": m, "guesses": total,
              "precision": round(right / total, 4)})  # fmt: skip


if __name__ == "__main__":
    main()
