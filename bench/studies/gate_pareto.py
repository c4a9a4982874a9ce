"""The gate's Pareto plot: mean KLD against delta bits per active expert weight, one point per
`moetier quality` JSON line (docs/quality.md, "The confidence gate"). Needs matplotlib
(`pip install -e '.[plot]'`).

    python bench/studies/gate_pareto.py plot docs/results/gate_sweep.jsonl docs/gate_pareto.png

and the threshold T of `weight*weight*sensitivity:T` that keeps a fraction F of a routing trace's
pairs (the trace's top-k probabilities renormalised, as norm_topk_prob routes):

    python bench/studies/gate_pareto.py threshold TRACE.npz STORE/gate_sensitivity.json F
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def family(delta: str) -> str:
    """A line's policy without its threshold or budget (the series it belongs to)."""
    if delta in ("none", "all"):
        return "base only / delta everywhere"
    text = delta.removeprefix("resident:")
    if text.startswith("budget:"):
        return "budget " + text.split(":", 2)[2]
    return text.rpartition(":")[0].replace("@", " @")


def main(src: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [json.loads(x) for x in Path(src).read_text().splitlines() if x.strip()]
    lines = [x for x in lines if x["chunks"] == 16]  # one text: the sweep's 16 chunks
    series: dict[str, list[tuple[float, float]]] = {}
    for line in lines:
        bits = line.get("delta_bits_per_active_weight", 0.0)
        series.setdefault(family(line["delta"]), []).append((bits, line["mean_kld"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    colors = plt.get_cmap("tab20").colors
    for i, (name, points) in enumerate(sorted(series.items())):
        points.sort()
        if name.startswith("base only"):  # the two ends, not a policy's curve
            ax.plot(*zip(*points, strict=True), "kx", markersize=9, label=name)
            continue
        ax.plot(*zip(*points, strict=True), marker="o", label=name, linewidth=1, color=colors[i])
    ax.set_xlabel("delta bits per active expert weight (base: 2.42)")
    ax.set_ylabel("mean KLD vs bf16")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    chunks = {line["chunks"] for line in lines}
    ax.set_title(f"eval-moe-70m, q2s + NVFP4 delta, {'/'.join(map(str, sorted(chunks)))} chunks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


def threshold(trace: str, table: str, fraction: float) -> float:
    import numpy as np

    data = np.load(trace)
    ids, p = data["expert_ids"].astype(int), data["router_probs"].astype(np.float64)
    w = p / p.sum(-1, keepdims=True)
    rows = json.loads(Path(table).read_text())["layers"]
    layers = sorted(int(k) for k in rows)
    sens = np.stack([np.array(rows[str(layer)]) for layer in layers])  # [L, E]
    score = w * w * sens[np.arange(len(layers))[:, None, None], ids]
    return float(np.quantile(score, 1 - fraction))


if __name__ == "__main__":
    if sys.argv[1] == "threshold":
        print(f"{threshold(sys.argv[2], sys.argv[3], float(sys.argv[4])):.6g}")
    else:
        main(sys.argv[2], sys.argv[3])
