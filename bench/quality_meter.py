"""The confidence gate's live quality meter against an offline measurement of the same text.

    PYTHONPATH=. python bench/quality_meter.py STORE --text TEXT [--delta weight:0.34]
        [--prompts 16] [--prompt-tokens 128] [--tokens 64] [--temperature 0] [--fraction 1]

Serves `--prompts` prompts cut from TEXT (`--prompt-tokens` each) through the serving engine
(native model, `--delta` rule, `--quality-meter F`), all queued at once, `--tokens` new tokens
each (sampled at `--temperature`, seeded), then measures offline, over each metered request's
prompt and output, the same figures with the transformers model class gated and with the delta
everywhere: mean KL(delta everywhere || gated) over the output positions and the share whose top
tokens differ. One JSON line: both figures, their ratio, the positions compared. A threshold
rule decides each pair alone; a budget rule's choice depends on the other rows of a step (a
twin's among them), so the two figures may differ by more for it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import emit  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402


def main() -> None:
    import torch

    from moetier.config import EngineConfig
    from moetier.engine.engine import Engine, EngineLimits
    from moetier.engine.sampler import SamplingParams
    from moetier.loader.load import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--delta", default="weight:0.34")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--fraction", type=float, default=1.0, help="--quality-meter")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    common = dict(device=args.device, dtype=args.dtype)
    loaded = load_model(args.store, EngineConfig(native=True, delta=args.delta, **common))
    ids = loaded.tokenizer.encode(args.text.read_text(encoding="utf-8"), add_special_tokens=False)
    size = args.prompt_tokens
    prompts = [ids[i * size : (i + 1) * size] for i in range(args.prompts)]
    if len(prompts[-1]) < size:
        raise SystemExit(f"{args.text} has too few tokens for {args.prompts} prompts of {size}")
    limits = EngineLimits(num_pages=4096, page_size=16, quality_meter=args.fraction)
    engine = Engine(loaded, limits)
    assert engine.meter is not None
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=args.temperature, seed=i, max_new_tokens=args.tokens)
        engine.add(f"p{i}", prompt, params, max_tokens=args.tokens, ignore_eos=True)
    metered = set(engine.meter.twin_of)
    outputs: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    meter = engine.meter.stats

    del engine, loaded
    offline = dict(native=False, **common)
    gated = load_model(args.store, EngineConfig(delta=args.delta, **offline))
    full = load_model(args.store, EngineConfig(delta="all", **offline))
    klds: list[float] = []
    differs = 0
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            if f"p{i}" not in metered:
                continue
            output = outputs[f"p{i}"]
            batch = torch.tensor([prompt + output], device=gated.device)
            span = slice(len(prompt) - 1, len(prompt) - 1 + len(output))
            g = torch.log_softmax(gated.model(batch).logits[0, span].double(), -1)
            f = torch.log_softmax(full.model(batch).logits[0, span].double(), -1)
            klds += (f.exp() * (f - g)).sum(-1).tolist()
            differs += int((f.argmax(-1) != g.argmax(-1)).sum())
    offline_kld = sum(klds) / max(1, len(klds))
    emit(
        {
            **run_info(),
            "bench": "quality_meter",
            "store": args.store.name,
            "text": args.text.name,
            "delta": args.delta,
            "config": {"prompts": len(prompts), "prompt_tokens": size, "tokens": args.tokens,
                       "temperature": args.temperature, "fraction": args.fraction},
            "metered_requests": meter.requests,
            "positions": meter.positions,
            "offline_positions": len(klds),
            "meter_mean_kld": round(meter.mean_kld, 6),
            "offline_mean_kld": round(offline_kld, 6),
            "ratio": round(meter.mean_kld / offline_kld, 4) if offline_kld else None,
            "meter_disagreement": round(meter.disagreement_rate, 4),
            "offline_disagreement": round(differs / max(1, len(klds)), 4),
        }
    )  # fmt: skip


if __name__ == "__main__":
    main()
