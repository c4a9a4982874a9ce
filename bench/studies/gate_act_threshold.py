"""The threshold of a gate rule with the `act` term that keeps a share of pairs, calibrated on a
text (docs/quality.md, "The confidence gate"): the store runs base only over `--chunks` chunks
of TEXT; at each experts call every pair's score a + b · act is computed as the op would
(gate/policies.act_split, the base hidden activation through the sketch, moe_ref), and the
threshold is the score that the best SHARE of all pairs reach. One JSON line (with the share each
MoE layer keeps at that threshold).

  PYTHONPATH=. python bench/studies/gate_act_threshold.py STORE TEXT \\
      [--rule 'weight*weight*act'] [--share 0.25] [--chunks 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from moetier.config import DeltaRule, EngineConfig
from moetier.engine.quality import chunks
from moetier.gate.policies import act_split, gate_up_energy
from moetier.gate.state import Gate
from moetier.gate.tables import write_table
from moetier.kernels.moe_ref import _expert_hidden, act_energy_ref, expert_matrix
from moetier.loader.load import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("text", help="calibration text (not the text the gate is judged on)")
    parser.add_argument("--rule", default="weight*weight*act", help="a SCORE with the act term")
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument(
        "--layer-table",
        help="also write a gate table (sensitivity@FILE) holding 1 / T_l, T_l the score the best "
        "SHARE of layer l's pairs reach: the rule SCORE*sensitivity@FILE:1 then keeps SHARE of "
        "each layer's calibration pairs (per-layer thresholds)",
    )
    args = parser.parse_args()
    rule = DeltaRule.parse(f"{args.rule}:0")
    assert rule is not None and "act" in rule.terms()
    loaded = load_model(args.store, EngineConfig(delta="none", native=False, dtype="float32"))
    store, runtime = loaded.store, loaded.runtime
    gate = Gate(rule, store.path, "cpu")
    assert gate.sketches is not None
    fmt_of = runtime.formats
    weights: dict[tuple[int, int], torch.Tensor] = {}
    scores: list[torch.Tensor] = []
    layers: list[int] = []

    def observe(layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        x = gate.inputs(layer, hidden, ids, w)
        a, b = act_split(rule, x)
        down, gu = gate.sketches[layer]  # type: ignore[index]
        energy = torch.zeros(ids.shape)
        if gu is not None:
            energy = energy + gate_up_energy(hidden, ids, gu)
        for e in ids.unique().tolist():
            blob: Any = store.read_blob(layer, e, "base")
            if (layer, e) not in weights:
                weights[(layer, e)] = expert_matrix(blob, fmt_of[layer], "gate_up")
            t, j = torch.where(ids == e)
            h = _expert_hidden(hidden[t].float(), weights[(layer, e)], blob, fmt_of[layer],
                               runtime.activation)  # fmt: skip
            energy[t, j] += act_energy_ref(h, down[e])
        scores.append((a + b * energy).flatten())
        layers.append(layer)

    runtime.observer = observe
    ids = loaded.tokenizer.encode(Path(args.text).read_text(), add_special_tokens=False)
    token_chunks = chunks(ids, args.ctx, args.chunks)
    with torch.inference_mode():
        for i in range(0, token_chunks.shape[0], 4):
            loaded.model(token_chunks[i : i + 4])
    flat = torch.cat(scores).double()
    keep = int(round(args.share * flat.numel()))
    threshold = float(f"{torch.sort(flat, descending=True).values[keep - 1].item():.6g}")
    kept = round(float((flat >= threshold).double().mean()), 4)
    by_layer: dict[int, list[torch.Tensor]] = {}
    for layer, part in zip(layers, scores, strict=True):
        by_layer.setdefault(layer, []).append(part)
    shares = {layer: round(float((torch.cat(p).double() >= threshold).double().mean()), 4)
              for layer, p in sorted(by_layer.items())}  # fmt: skip
    if args.layer_table:
        rows = {}
        for layer, parts in sorted(by_layer.items()):
            values = torch.cat(parts).double()
            n = int(round(args.share * values.numel()))
            t_l = float(torch.sort(values, descending=True).values[n - 1])
            rows[layer] = [1.0 / t_l] * store.model_config.num_experts
        how = f"1 / the {args.rule} score the best {args.share} of each layer's pairs reach"
        write_table(Path(args.layer_table), "sensitivity", rows, how + f" ({Path(args.text).name})")
    print(json.dumps({"rule": args.rule, "share": args.share, "text": Path(args.text).name,
                      "chunks": args.chunks, "pairs": flat.numel(),
                      "threshold": threshold, "kept": kept, "kept_by_layer": shares}))  # fmt: skip


if __name__ == "__main__":
    main()
