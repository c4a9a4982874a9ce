"""`moetier quality STORE --reference HF_DIR --text FILE`: KL divergence and perplexity of a
store against the Hugging Face model's logits (llama-perplexity protocol); one JSON line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from moetier.cli.flags import add_dataclass_arguments, dataclass_from_args
from moetier.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="the moetier store to evaluate")
    parser.add_argument(
        "--reference", required=True, help="Hugging Face model directory (reference logits)"
    )
    parser.add_argument("--text", required=True, help="UTF-8 text file to score")
    parser.add_argument(
        "--ctx",
        type=int,
        default=512,
        help="chunk length; the second half is scored (default: 512)",
    )
    parser.add_argument(
        "--chunks", type=int, default=0, help="score at most this many chunks (0 = all)"
    )
    parser.add_argument("--batch-size", type=int, default=4, help="chunks per forward (default: 4)")
    add_dataclass_arguments(parser, EngineConfig, "engine")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from moetier.engine.quality import chunks, compare
    from moetier.loader.load import load_model

    engine_config = dataclass_from_args(EngineConfig, args)
    # full-sequence logits come from the transformers model class (the native model is
    # checked against the same oracle in tests/models/test_native.py)
    engine_config = EngineConfig(**{**engine_config.__dict__, "native": False})
    if engine_config.dtype == "auto":
        engine_config = EngineConfig(**{**engine_config.__dict__, "dtype": "float32"})
    loaded = load_model(args.store, engine_config)
    reference = AutoModelForCausalLM.from_pretrained(
        args.reference, dtype=loaded.dtype, experts_implementation="eager"
    )
    reference = reference.to(loaded.device).eval()  # type: ignore[arg-type]
    text = Path(args.text).read_text(encoding="utf-8")
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    token_chunks = chunks(ids, args.ctx, args.chunks)

    def ours(batch: torch.Tensor) -> torch.Tensor:
        return loaded.model(batch.to(loaded.device)).logits

    def theirs(batch: torch.Tensor) -> torch.Tensor:
        return reference(batch.to(loaded.device)).logits

    report = compare(
        ours,
        theirs,
        token_chunks,
        args.batch_size,
        progress=lambda it: tqdm(
            it,
            total=-(-len(token_chunks) // args.batch_size),
            desc="chunks",
            disable=not sys.stderr.isatty(),
        ),
    )
    store = loaded.store
    line = {
        "store": store.path.name,
        "reference": Path(args.reference).name,
        "text": Path(args.text).name,
        "protocol": f"chunks of {args.ctx}, second half scored",
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "experts_format": sorted(store.formats),
        "experts_bpw": round(store.expert_bits_per_weight, 4),
        "delta": engine_config.delta if store.has_plane("delta") else "no delta plane",
        "delta_rate": round(loaded.runtime.delta_pairs / max(1, loaded.runtime.pairs), 4),
        **{k: round(v, 6) if isinstance(v, float) else v for k, v in report.to_dict().items()},
        "commit": _commit(),
    }
    print(json.dumps(line))
    return 0


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
