"""Wall time and peak memory of calibrated conversion on a Qwen3-30B-A3B-shaped checkpoint.

Writes a random bf16 qwen3_moe checkpoint of the Qwen3-30B-A3B widths (hidden 2048, 128 experts
of intermediate 768, top-8; `--layers` of its 48, vocab 32,000, 512 MiB shards) with
eval-moe-70m's tokenizer, then runs `moetier convert --experts q2s --calibration TEXT` in a
child process, sampling its peak RSS (bench/convert_rss.py's `measure`); the converter prints
its peak GPU memory. One JSON line per calibration mode; per-layer seconds let the full model
be extrapolated.

    python bench/convert_calibrated.py --layers 8 --tokens 65536          # on the device
    python bench/convert_calibrated.py --layers 2 --tokens 2048 --experts 16 --modes diag
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from convert_rss import SHARD_BYTES, checkpoint_tensors, measure

from moetier.core.provenance import run_info

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "models" / "eval-moe-70m"
TEXT = ROOT.parent / "shared" / "data" / "gutenberg" / "train"


def write(path: Path, layers: int, experts: int) -> tuple[int, int]:
    """Random shards (as convert_rss.write_checkpoint) of the Qwen3-30B-A3B widths."""
    from safetensors.torch import save_file

    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for f in EVAL.iterdir():  # the tokenizer (its ids < 8192 fit the vocab)
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copyfile(f, path / f.name)
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = largest = 0
    for key, shape in checkpoint_tensors(config) + [(None, ())]:
        nbytes = 2 * math.prod(shape) if key else 0
        if shard and (key is None or size + nbytes > SHARD_BYTES):
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0
        if key is None:
            break
        if len(shape) == 1:
            shard[key] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            shard[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += nbytes
        total += nbytes
        largest = max(largest, nbytes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--modes", default="gptq,diag")
    parser.add_argument("--calibration", default=str(TEXT))
    parser.add_argument("--tmp", default=None, help="parent of the temporary directory")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="convert-calibrated-", dir=args.tmp))
    try:
        src = root / "hf"
        src.mkdir()
        total, largest = write(src, args.layers, args.experts)
        for mode in args.modes.split(","):
            dst = root / f"store-{mode}"
            cmd = [sys.executable, "-m", "moetier", "convert", str(src), str(dst)]
            cmd += ["--experts", "q2s", "--calibration", args.calibration]
            cmd += ["--calibration-mode", mode, "--calibration-tokens", str(args.tokens)]
            start = time.perf_counter()
            result = measure(cmd)
            shutil.rmtree(dst)
            line = {
                "bench": "convert_calibrated",
                "mode": mode,
                "layers": args.layers,
                "experts": args.experts,
                "tokens": args.tokens,
                "checkpoint_bytes": total,
                "largest_tensor_bytes": largest,
                "shard_bytes": SHARD_BYTES,
                "wall_s": round(time.perf_counter() - start, 1),
                "s_per_layer": round(result["wall_s"] / args.layers, 2),
                **{k: v for k, v in result.items() if k != "output"},
                "converter_output": result["output"],
                **run_info(),
            }
            print(json.dumps(line), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
