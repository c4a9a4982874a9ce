"""Speculative decoding with an MTP layer: acceptance on real text, and greedy output checked
against decoding without it.

    PYTHONPATH=. python bench/speculative.py STORE --mtp-file MTP.safetensors \\
        --tokens-file ../shared/models/eval-moe-70m/heldout_tokens.npz [--k 1,2,3] \\
        [--prompts 16] [--prompt-tokens 128] [--new-tokens 64]

Prompts are cut from the held-out tokens (`--tokens-file`, key `tokens`), all queued at once,
greedy, `--new-tokens` each. One JSON line per k: drafts accepted by position, the share
accepted, the mean accepted per verify step, the tokens a step gives a request (1 + that),
whether every output equals the run without MTP, and both runs' seconds (CPU: not a speed
figure of the GPU path)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import emit  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402


def main() -> None:
    import numpy as np

    from moetier.config import EngineConfig
    from moetier.engine.engine import Engine, EngineLimits
    from moetier.engine.sampler import SamplingParams
    from moetier.loader.load import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--mtp-file", required=True)
    parser.add_argument("--tokens-file", type=Path, required=True)
    parser.add_argument("--k", default="1,2,3")
    parser.add_argument("--policy", default="always", help="--speculative-policy (always: "
                        "drafts at every step, acceptance over all of them)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    tokens = np.load(args.tokens_file)["tokens"].astype(np.int64)
    size = args.prompt_tokens
    stride = len(tokens) // args.prompts  # prompts spread over the whole text
    prompts = [tokens[i * stride : i * stride + size].tolist() for i in range(args.prompts)]
    config = EngineConfig(native=True, device=args.device, dtype=args.dtype,
                          mtp_file=args.mtp_file)  # fmt: skip
    loaded = load_model(args.store, config)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)

    def run(k: int) -> tuple[dict[str, list[int]], float, Engine]:
        limits = EngineLimits(num_pages=4096, page_size=16, speculative_tokens=k,
                              speculative_policy=args.policy)  # fmt: skip
        engine = Engine(loaded, limits)
        began = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add(f"p{i}", prompt, greedy, max_tokens=args.new_tokens, ignore_eos=True)
        out: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
        while engine.has_work:
            for o in engine.step():
                out[o.request_id] += o.token_ids
        return out, time.perf_counter() - began, engine

    plain, plain_s, _ = run(0)

    def share(accepted: list[int], drafted: list[int]) -> list[float | None]:
        return [round(a / d, 4) if d else None for a, d in zip(accepted, drafted, strict=True)]

    for k in [int(v) for v in args.k.split(",")]:
        got, seconds, engine = run(k)
        assert engine.runner.drafter is not None
        stats = engine.runner.drafter.stats
        emit({**run_info(), "bench": "speculative", "store": args.store.name,
              "mtp_file": Path(args.mtp_file).name, "text": args.tokens_file.name,
              "config": {"k": k, "policy": args.policy, "prompts": len(prompts),
                         "prompt_tokens": size, "new_tokens": args.new_tokens,
                         "dtype": args.dtype},
              "drafted_by_position": stats.drafted, "accepted_by_position": stats.accepted,
              "acceptance_by_position": share(stats.accepted, stats.drafted),
              "acceptance": round(stats.acceptance, 4),
              "mean_accepted": round(stats.mean_accepted, 4),
              "tokens_per_step": round(1 + stats.mean_accepted, 4),
              "identical_to_no_mtp": got == plain,
              "seconds": round(seconds, 2), "seconds_no_mtp": round(plain_s, 2)})  # fmt: skip


if __name__ == "__main__":
    main()
