"""bench/ncu_sass_summary.py reads Nsight Compute's source-page CSV (the layout ncu 2025.3
writes: a "Kernel Name" row, then per kernel a header row holding "Address" and one row per
SASS line) into per-opcode shares and the most-stalled lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench"
HEADER = ("Address,Source,Warp Stall Sampling (All Samples),Instructions Executed,"
          "stall_long_sb,stall_barrier,stall_long_sb (Not Issued)")  # fmt: skip
ROWS = [
    '0x10,"IDP.4A.U8.S8 R1, R1, R2, RZ",30,"1,000",20,0,5',
    '0x20,"@P0 LDG.E.128 R4, desc[UR4][R6.64]",10,250,10,0,10',
    '0x30,"BAR.SYNC.DEFER_BLOCKING 0x0",60,250,0,55,0',
]


def test_summary_of_two_kernels(tmp_path):
    name = '"Kernel Name","_q2s_gemv_kernel",'
    text = "\n".join([name, HEADER, *ROWS, name, HEADER, ROWS[0]])
    path = tmp_path / "src.csv"
    path.write_text(text + "\n")
    out = subprocess.run([sys.executable, str(BENCH / "ncu_sass_summary.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["sass_lines"] == 3 and second["sass_lines"] == 1
    assert first["warp_instructions"] == 1500 and first["stall_samples"] == 100
    assert first["ops"]["IDP"] == {"executed": round(1000 / 1500, 4), "stalls": 0.3}
    assert first["ops"]["LDG"]["executed"] == round(250 / 1500, 4)  # predicate dropped
    top = first["top_stalls"][0]
    assert top["sass"].startswith("BAR.SYNC") and top["stall_share"] == 0.6
    assert top["reasons"] == {"stall_barrier": 55.0}  # "(Not Issued)" columns are not reasons
