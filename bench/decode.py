"""Resident decode (issue #7): tok/s of the native qwen3_moe model with every expert on the GPU,
one decode step (and its greedy feedback) replayed from a CUDA graph, next to HF transformers
(batched_mm experts) on the same shape, and achieved bandwidth on active bytes next to the copy
bandwidth measured in the same run. One JSON line per case.

  python bench/decode.py --resident --layers 8 --batch 1,4,16     # the 8-layer slice
  python bench/decode.py --resident --layers 48 --batch 1          # the full Qwen3-30B-A3B shape

Weights are random (synthetic store written directly in q2s form, quant/synthetic.py); routing
is the model's own router on them (near-uniform). Active bytes per step: every dense weight
(attention, routers, norms, lm_head; one embedding row per sequence) plus, per MoE layer, the
expected number of distinct experts a batch touches under uniform routing times an expert's
bytes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.engine.static_decode import StaticDecoder
from moetier.loader.load import load_model
from moetier.quant.store import Store
from moetier.quant.synthetic import QWEN3_30B_A3B, write_synthetic_store

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, emit, run_info  # noqa: E402

PROMPT = 16


def active_bytes(store: Store, batch: int) -> int:
    from safetensors import safe_open

    cfg = store.model_config
    dense = 0
    with safe_open(str(store.path / "dense.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            numel = 1
            for d in t.get_shape():
                numel *= d
            if "embed_tokens" in key:
                numel = batch * cfg.hidden_size
            dense += numel * 2
    expert = next(iter(store.blobs.values())).nbytes
    distinct = cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** batch)
    return int(dense + len(store.moe_layers) * distinct * expert)


def profile_step(dec: StaticDecoder, steps: int = 4) -> list[dict[str, object]]:
    """CUDA kernels of `steps` eager decode steps: the 25 largest by total time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step_static()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / steps,
                         "us_per_step": round(us / steps, 1)})  # fmt: skip
    rows.sort(key=lambda r: -float(r["us_per_step"]))  # type: ignore[arg-type]
    total = sum(float(r["us_per_step"]) for r in rows)  # type: ignore[arg-type]
    calls = sum(float(r["calls_per_step"]) for r in rows)  # type: ignore[arg-type]
    return [{"kernel": "TOTAL", "calls_per_step": calls, "us_per_step": round(total, 1)}] + rows[
        :25
    ]


def time_native(
    store_path: Path, batch: int, steps: int, compile_step: bool, profile: bool = False
) -> dict[str, object]:
    loaded = load_model(store_path, EngineConfig(device="cuda", dtype="bfloat16", native=True))
    loaded.runtime.pin_all()
    vocab = loaded.model_config.vocab_size
    dec = StaticDecoder(
        loaded.model, batch, PROMPT + steps + 8, torch.bfloat16, "cuda", compile_step=compile_step
    )
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, PROMPT), generator=gen).tolist()
    with torch.inference_mode():
        logits = dec.prefill(prompts)
        dec.input_ids.copy_(logits.argmax(-1)[:, None])
        # eager (uncaptured) steps, for the overhead the graph removes; one first step
        # compiles the decode-shape kernels
        dec.step_static()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(8):
            dec.input_ids.copy_(dec.step_static().argmax(-1)[:, None])
            dec.positions.add_(1)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - start) / 8 * 1e3
        kernels = profile_step(dec) if profile else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dec.step_static()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec.input_ids.copy_(dec.step_static().argmax(-1)[:, None])  # greedy feedback
            dec.positions.add_(1)
        replays = steps - 8 - 2
        graph.replay()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
    ms = begin.elapsed_time(end) / replays
    del graph, dec, loaded
    torch.cuda.empty_cache()
    return {"ms": ms, "eager_ms": eager_ms, "kernels": kernels}


def time_hf(layers: int, batch: int, new_tokens: int) -> float:
    """ms per decode step of HF transformers generate (bf16, batched_mm experts): the time of
    `new_tokens` tokens minus that of one (prefill + first token), over new_tokens - 1 steps."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**dict(QWEN3_30B_A3B, num_hidden_layers=layers))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, experts_implementation="batched_mm"
        ).eval()
    ids = torch.randint(0, config.vocab_size, (batch, PROMPT), device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0)

    def run(tokens: int, model: torch.nn.Module = model) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        run(2)  # warm-up
        one = min(run(1) for _ in range(3))
        full = run(new_tokens)
    del model
    torch.cuda.empty_cache()
    return (full - one) / (new_tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resident", action="store_true", help="every expert on the GPU")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", default="1,4,16")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--experts", default="q2s", help="q2s and/or bfloat16, comma separated")
    parser.add_argument("--hf-tokens", type=int, default=16, help="0 skips the HF baseline")
    parser.add_argument(
        "--compile",
        default="on",
        choices=("on", "off", "both"),
        help="decode step through torch.compile before the CUDA graph",
    )
    parser.add_argument("--profile", action="store_true", help="kernel table of eager steps")
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    if args.steps < 16:
        parser.error("--steps must be at least 16 (8 eager steps, then the timed replays)")
    if not args.resident:
        parser.error("only --resident is implemented (tiered decode is issue #6's bench)")
    info = run_info()
    copy_bw = copy_bandwidth()
    emit({**info, "case": "copy", "GB/s": round(copy_bw / 1e9, 1)})
    shape = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    for experts in args.experts.split(","):
        start = time.perf_counter()
        path = write_synthetic_store(
            args.tmp / f"moetier-decode-{experts}-{args.layers}", shape, experts, DEFAULT_STORE
        )
        print(f"# store written in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        store = Store(path)
        modes = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
        for batch, compiled in ((int(b), c) for b in args.batch.split(",") for c in modes):
            t = time_native(path, batch, args.steps, compiled, args.profile)
            ms = float(t["ms"])  # type: ignore[arg-type]
            nbytes = active_bytes(store, batch)
            if t["kernels"]:
                for row in t["kernels"]:  # type: ignore[union-attr]
                    emit({**info, "case": "decode-profile", "layers": args.layers,
                          "batch": batch, "compiled": compiled, **row})  # fmt: skip
            rec = {**info, "case": "decode-resident", "layers": args.layers, "batch": batch,
                   "experts": experts, "compiled": compiled, "ms_per_step": round(ms, 4),
                   "tok_s": round(batch * 1e3 / ms, 1),
                   "eager_ms_per_step": round(float(t["eager_ms"]), 3),  # type: ignore[arg-type]
                   "active_MB": round(nbytes / 1e6, 1),
                   "GB/s": round(nbytes / ms / 1e6, 1),
                   "copy_GB/s": round(copy_bw / 1e9, 1)}  # fmt: skip
            first = compiled == modes[-1] and experts == args.experts.split(",")[0]
            if args.hf_tokens and first:
                hf_ms = time_hf(args.layers, batch, args.hf_tokens)
                rec.update(hf_batched_mm_tok_s=round(batch * 1e3 / hf_ms, 2),
                           vs_hf=round(hf_ms / ms, 1))  # fmt: skip
            emit(rec)
        store.close()


if __name__ == "__main__":
    main()
