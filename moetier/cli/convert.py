"""`moetier convert HF_DIR OUT_DIR [--experts q2s --calibration TEXT]`."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("out_dir", help="where to write the moetier store")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument(
        "--experts",
        choices=("source", "q2s", "nvfp4", "mxfp4", "nested"),
        default="source",
        help="routed expert format: the checkpoint's (its dtype; FP8 dequantised; an NVFP4/MXFP4 "
        "checkpoint's own codes), q2s 2-bit, FP4, or nested (FP4 split into a 2-bit base plane "
        "and a 2-bit delta plane; from an FP4 checkpoint, its own codes) (default: source)",
    )
    parser.add_argument(
        "--delta",
        choices=("none", "nvfp4"),
        default="none",
        help="with --experts q2s: add a delta plane, NVFP4 codes of the q2s error, applied at "
        "run time where the engine's --delta says (default: none)",
    )
    parser.add_argument(
        "--group", type=int, default=32, help="q2s group size of gate/up (default: 32)"
    )
    parser.add_argument(
        "--down-group",
        type=int,
        default=16,
        help="q2s group size of down_proj, the more sensitive matrix (default: 16)",
    )
    parser.add_argument(
        "--calibration",
        help="text file or folder of .txt for GPTQ rounding (without it q2s rounds to nearest)",
    )
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=65536,
        help="calibration tokens to run (default: 65536)",
    )


def run(args: argparse.Namespace) -> int:
    from moetier.quant.convert import convert
    from moetier.quant.store import DENSE_FILE, Store

    start = time.perf_counter()
    progress = sys.stderr.isatty()
    if args.experts != "source":
        from moetier.loader.quantize import convert_quantized

        out = convert_quantized(
            args.hf_dir,
            args.out_dir,
            args.experts,
            delta=None if args.delta == "none" else args.delta,
            calibration=args.calibration,
            calibration_tokens=args.calibration_tokens,
            group=args.group,
            down_group=args.down_group,
            force=args.force,
            progress=progress,
        )
    else:
        if args.calibration or args.delta != "none":
            raise ValueError("--calibration and --delta apply to --experts q2s")
        out = convert(args.hf_dir, args.out_dir, force=args.force, progress=progress)
    store = Store(out)
    cfg = store.model_config
    expert_params, expert_bytes = store.expert_params, store.expert_bytes
    dense_params, dense_bytes = _dense_size(store.path / DENSE_FILE)
    delta = ""
    if store.has_plane("delta"):
        delta = f" (+{store.plane_bits_per_weight('delta'):.3f} where the delta plane is applied)"
    print(
        f"wrote {out}: {len(store.moe_layers)} MoE layers x {cfg.num_experts} experts, "
        f"{'/'.join(sorted(store.formats))}; experts {expert_bytes / 2**20:.1f} MiB, "
        f"{store.expert_bits_per_weight:.3f} bits per weight{delta}; whole store "
        f"{(expert_bytes + dense_bytes) / 2**20:.1f} MiB at "
        f"{8 * (expert_bytes + dense_bytes) / (expert_params + dense_params):.3f} bits per weight; "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0


def _dense_size(path: Path) -> tuple[int, int]:
    """(parameters, bytes) of a safetensors file, from its header alone."""
    from moetier.quant.convert import read_safetensors_header

    params = nbytes = 0
    for key, info in read_safetensors_header(path).items():
        if key == "__metadata__":
            continue
        params += math.prod(info["shape"])
        nbytes += info["data_offsets"][1] - info["data_offsets"][0]
    return params, nbytes
