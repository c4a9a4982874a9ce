"""`moetier convert HF_DIR OUT_DIR`."""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("out_dir", help="where to write the moetier store")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")


def run(args: argparse.Namespace) -> int:
    from moetier.quant.convert import convert
    from moetier.quant.store import Store

    start = time.perf_counter()
    out = convert(args.hf_dir, args.out_dir, force=args.force, progress=sys.stderr.isatty())
    store = Store(out)
    expert_bytes = sum(b.nbytes for b in store.blobs.values())
    print(
        f"wrote {out}: {len(store.moe_layers)} MoE layers x "
        f"{store.model_config.num_experts} experts "
        f"({expert_bytes / 2**20:.1f} MiB of experts, {store.source_dtype}) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0
