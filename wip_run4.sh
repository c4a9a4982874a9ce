#!/bin/bash
export PYTHONPATH=$PWD
export MOETIER_COMMIT=ab1faf9
timeout 150 python3 bench/kernels.py --shapes qwen3-30b-a3b,deepseek-v3 --tokens 1,2 --no-baseline --formats q2s \
  --variant gu:next_l2=0 --variant gu:next_l2=1,next_l2_at=0 --variant gu:maxnreg=128 > $OUT/ab-configs.jsonl 2>>$OUT/err.txt
timeout 400 python3 bench/kernels.py --shapes deepseek-v3,deepseek-v4-flash,qwen3-30b-a3b --tokens 1,2,4,8,16 \
  --no-baseline --formats q2s,q2s+nvfp4,q2s-hot --read-floor > $OUT/table.jsonl 2>>$OUT/err.txt
python3 - <<'PY'
import json, os
for f in ("ab-configs.jsonl", "table.jsonl"):
    for l in open(os.environ["OUT"] + "/" + f):
        if not l.startswith("{"): continue
        r = json.loads(l)
        if "shape" in r:
            print(r["shape"][:8], r["tokens"], r.get("format"), r.get("ms"), r.get("of_copy"), r.get("vs_dispatcher") or r.get("vs_predicted") or "")
        else:
            print(r.get("case"), r.get("GB/s"))
PY
tail -3 $OUT/err.txt
