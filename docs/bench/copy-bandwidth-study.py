"""The copy bandwidth measured six times in one process (copy-bandwidth-study-h200.txt): one
median of 20 copies ("old") against the best of five ("new"); argument: which comes first.
Run from the repository root with bench/ on the path."""

import sys

sys.path.insert(0, "bench")
import torch  # noqa: E402
from common import copy_bandwidth  # noqa: E402

first = sys.argv[1]
torch.zeros(1, device="cuda")
order = ["old", "new", "old", "new", "old", "new"] if first == "old" else ["new", "old"] * 3
out = []
for kind in order:
    bw = copy_bandwidth(samples=1 if kind == "old" else 5)
    out.append(f"{kind} {bw / 1e9:.1f}")
print(first, "first:", ", ".join(out), flush=True)
