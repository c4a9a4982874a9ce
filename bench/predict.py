"""Prefetch prediction quality on eval-moe-70m: a later layer's router on an earlier hidden state.

    PYTHONPATH=. python bench/predict.py [--windows 16] [--window 512] [--start 16384]

Runs the HF model (fp32, CPU) over windows of held-out tokens (heldout_tokens.npz, from token
--start on), records each decoder layer's input and output and each router's top-k, then for
every target layer J scores these guesses of J's experts (moetier.residency.predict):
  out(J-1)   J's norm + router on layer J-1's output (the residual stream after J-1)
  in(J-1)    the same on layer J-1's input, which is layer J-2's output: the guess two layers
             ahead
  prev-token the experts J chose for the previous token (a baseline needing no router)
each with m = k and m = 2k guesses per token. One JSON line per (target layer, source, m).
A last line compares the model's routing of the first window of held-out tokens with
router_trace.npz (which NOTES.md says covers the first 16,384 held-out tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moetier.core.provenance import git_commit
from moetier.residency.predict import predict_experts, prediction_quality

EVAL_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "eval-moe-70m"


def capture(model: torch.nn.Module, windows: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per layer: input [N, H], output [N, H], router top-k [N, k], N = all window tokens."""
    layers = model.model.layers  # type: ignore[union-attr]
    rec: dict[str, list[list[torch.Tensor]]] = {
        name: [[] for _ in layers] for name in ("in", "out", "topk")
    }
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(
            layer.register_forward_pre_hook(lambda m, a, i=i: rec["in"][i].append(a[0][0]))
        )
        hooks.append(
            layer.register_forward_hook(
                lambda m, a, o, i=i: rec["out"][i].append((o[0] if isinstance(o, tuple) else o)[0])
            )
        )
        hooks.append(
            layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: rec["topk"][i].append(o[2]))
        )
    try:
        with torch.no_grad():
            for window in windows:
                model(window[None])
    finally:
        for h in hooks:
            h.remove()
    return {name: [torch.cat(parts) for parts in per_layer] for name, per_layer in rec.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=EVAL_MODEL)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--start", type=int, default=16384, help="first held-out token used")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokens = np.load(args.model / "heldout_tokens.npz")["tokens"].astype(np.int64)
    n = args.windows * args.window
    windows = torch.from_numpy(tokens[args.start : args.start + n]).view(args.windows, args.window)
    started = time.perf_counter()
    rec = capture(model, windows)
    seconds = round(time.perf_counter() - started, 1)
    cfg = model.config
    k, num_layers = cfg.num_experts_per_tok, cfg.num_hidden_layers
    base = {
        "bench": "predict",
        "commit": git_commit(),
        "model": args.model.name,
        "dtype": "fp32",
        "tokens": n,
        "heldout_start": args.start,
        "window": args.window,
        "experts": cfg.num_experts,
        "top_k": k,
        "forward_seconds": seconds,
    }
    # Within a window the previous token is the previous row; the first token of each window has
    # no previous one and is left out of that baseline.
    not_first = torch.arange(n) % args.window != 0
    for target in range(1, num_layers):
        layer = model.model.layers[target]
        router = layer.mlp.gate.weight.detach()
        norm = layer.post_attention_layernorm
        actual = rec["topk"][target]
        sources = {
            "out(J-1)": rec["out"][target - 1],
            "in(J-1)": rec["in"][target - 1],
        }
        for m in (k, 2 * k):
            for name, hidden in sources.items():
                pred = predict_experts(
                    hidden, router, m, norm.weight.detach(), norm.variance_epsilon
                )
                q = prediction_quality(pred, actual)
                line = {**base, "target_layer": target, "source": name, "m": m}
                line |= {"precision": round(q.precision, 4), "recall": round(q.recall, 4)}
                print(json.dumps(line), flush=True)
            if m == k:  # the previous token's set has exactly k experts
                prev = torch.roll(actual, 1, dims=0)[not_first]
                q = prediction_quality(prev, actual[not_first])
                line = {**base, "target_layer": target, "source": "prev-token", "m": k}
                line |= {"precision": round(q.precision, 4), "recall": round(q.recall, 4)}
                print(json.dumps(line), flush=True)
    trace_path = args.model / "router_trace.npz"
    if trace_path.exists():
        trace = torch.from_numpy(np.load(trace_path)["expert_ids"].astype(np.int64))  # [L, T, k]
        first = torch.from_numpy(tokens[: args.window])[None]
        topk = capture(model, first)["topk"]
        agree = [
            prediction_quality(topk[layer], trace[layer, : args.window]).precision
            for layer in range(num_layers)
        ]
        line = {
            **base,
            "check": "router_trace.npz vs this model, first window",
            "tokens": args.window,
        }
        print(json.dumps(line | {"set_agreement_per_layer": [round(a, 4) for a in agree]}))


if __name__ == "__main__":
    sys.exit(main())
