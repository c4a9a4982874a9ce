"""The serving engine (engine/engine.py) under concurrent requests: per concurrency C, C requests
of `--prompt-tokens` random tokens each generating `--new-tokens` (ignore_eos) are queued at once
and stepped to the end. One JSON line per case: aggregate output tok/s over the decode steps
(after every prompt is read), TTFT p50 / p99, time per output token, the KV pages used at the
peak, and the per-step figure of a decode step (ms) beside HBM copy speed measured in the same
run. Synthetic q2s store of a bench shape (quant/synthetic.py), every expert pinned, the native
model over the paged KV cache (decode steps replayed from CUDA graphs per batch bucket).

With --agent-turns N, instead: one conversation of N turns as an agent sends it: the first
turn --first-tokens (a system prompt and tool definitions), each later turn the whole
conversation so far plus --turn-tokens new tokens (a user message or a tool's result), each
answered with --answer-tokens tokens; per turn its TTFT with the earlier turns' pages in the
prefix cache, beside the cold TTFT of a prompt of the same length whose first token is the
turn's own (no prefix hit: neither the conversation's pages nor an earlier cold prompt's;
`cold_cached_tokens` 0), and the prefix hit; after a first pass of the same shape with other
tokens (not reported), so that no turn's figure carries a first-time cost. With --profile-turn,
then one more warm turn under the profilers (where its first token's time goes). With
--concurrency as well, the streams' cases run first on the same engine (one load and compile).

  python bench/serve.py --layers 8 --concurrency 1,4,16,64
  python bench/serve.py --layers 8 --agent-turns 8 --first-tokens 5000 --turn-tokens 200 \
      --answer-tokens 200 [--profile-turn]   # the agent shape: 8 turns growing to ~8K tokens
  python bench/serve.py --layers 8 --concurrency 1,64 --profile 32   # + where a step's time goes
  python bench/serve.py --device cpu --shape tiny --layers 2 --concurrency 1,4   # smoke test
  python bench/serve.py --shape glm-5 --layers 4 --concurrency 1 [--native off]   # real shapes:
      glm-5, deepseek-v4-flash (quant/synthetic.SHAPES); --native off runs the transformers class
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import emit  # noqa: E402  (bench/ is on sys.path when run as a script)

from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.core.provenance import run_info
from moetier.engine.benchmark import decode_path
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.quant.store import Store
from moetier.quant.synthetic import shape, write_synthetic_store
from moetier.residency.links import copy_bandwidth


def run_case(engine: Engine, concurrency: int, prompt: int, new: int, seed: int) -> dict:
    vocab = engine.loaded.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    greedy = SamplingParams(temperature=0, max_new_tokens=new)
    start = time.perf_counter()
    for i in range(concurrency):
        ids = torch.randint(10, vocab, (prompt,), generator=gen).tolist()
        engine.add(f"c{concurrency}-{i}", ids, greedy, max_tokens=new, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    decode_began = None
    decode_tokens = 0
    steps = 0
    peak_pages = 0
    sync = torch.cuda.synchronize if engine.loaded.device.type == "cuda" else (lambda: None)
    while engine.has_work:
        outputs = engine.step()
        steps += 1
        peak_pages = max(peak_pages, engine.pool.used_pages)
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now - start)
            last[out.request_id] = now - start
        if decode_began is None and len(first) == concurrency:
            sync()
            decode_began = time.perf_counter()
            continue
        if decode_began is not None:
            decode_tokens += len(outputs)
    sync()
    decode_s = time.perf_counter() - (decode_began or start)
    ttft = sorted(first.values())
    # time per output token of each request: from its first token to its last
    tpot = sorted((last[r] - first[r]) / max(1, new - 1) for r in first)
    decode_steps = new - 1
    return {
        "concurrency": concurrency,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "steps": steps,
        "decode_tok_s": round(decode_tokens / decode_s, 1) if decode_s > 0 else None,
        "ms_per_decode_step": round(1e3 * decode_s / max(1, decode_steps), 4),
        "ttft_ms_p50": round(1e3 * statistics.median(ttft), 2),
        "ttft_ms_p99": round(1e3 * _p99(ttft), 2),
        "tpot_ms_p50": round(1e3 * statistics.median(tpot), 4),
        "tpot_ms_p99": round(1e3 * _p99(tpot), 4),
        "peak_kv_pages": peak_pages,
        "graphs": sorted(getattr(engine.runner, "graphs", {})),
        "steps_ahead_taken": getattr(engine.runner, "ahead_taken", 0),
    }


def profile_steps(engine: Engine, concurrency: int, prompt: int, steps: int, seed: int) -> dict:
    """`steps` decode steps of `concurrency` streams under torch.profiler -> where a step's time
    goes: wall ms per step and the top GPU kernels (device µs per step, calls per step)."""
    vocab = engine.loaded.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    new = 2 * steps + 16
    greedy = SamplingParams(temperature=0, max_new_tokens=new)
    for i in range(concurrency):
        ids = torch.randint(10, vocab, (prompt,), generator=gen).tolist()
        engine.add(f"p{concurrency}-{i}", ids, greedy, max_tokens=new, ignore_eos=True)
    started: set[str] = set()
    while len(started) < concurrency:  # every prompt read, every stream decoding
        started.update(out.request_id for out in engine.step())
    for _ in range(4):
        engine.step()
    record = profile_runs(engine, lambda: [engine.step() for _ in range(steps)], steps)
    while engine.has_work:
        engine.step()
    return {"case": "serve-profile", "concurrency": concurrency, **record}


def profile_runs(engine: Engine, run: Callable[[], object], runs: int) -> dict:
    """`run` (which does `runs` steps or turns) under torch.profiler, then again under cProfile
    -> where one's time goes: wall ms, the top GPU kernels (device µs and calls per run), the
    host's runtime calls (CPU µs per run: launches, copies, synchronizations) and its Python."""
    cuda = engine.loaded.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        began = time.perf_counter()
        run()
        sync()
        wall = time.perf_counter() - began
    host = cProfile.Profile()  # the host's Python: where its share goes
    host.enable()
    run()
    sync()
    host.disable()
    by_function = pstats.Stats(host).stats  # type: ignore[attr-defined]
    host_top = sorted(by_function.items(), key=lambda kv: -kv[1][2])[:12]

    def own_us(e: Any) -> float:  # GPU time on CUDA, else the op's own CPU time
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    averages = prof.key_averages()
    events = [e for e in averages if own_us(e) > 0]
    gpu_us = sum(own_us(e) for e in events)
    runtime = [e for e in averages if e.key.startswith("cuda") and e.self_cpu_time_total > 0]
    return {
        "runs": runs,
        "wall_ms_per_run": round(1e3 * wall / runs, 4),
        "gpu_ms_per_run": round(gpu_us / 1e3 / runs, 4),
        "kernels": [
            {
                "name": e.key[:90],
                "us_per_run": round(own_us(e) / runs, 2),
                "calls_per_run": round(e.count / runs, 2),
            }
            for e in sorted(events, key=lambda e: -own_us(e))[:16]
        ],
        "runtime_calls": [
            {
                "name": e.key[:60],
                "cpu_us_per_run": round(e.self_cpu_time_total / runs, 1),
                "calls_per_run": round(e.count / runs, 2),
            }
            for e in sorted(runtime, key=lambda e: -e.self_cpu_time_total)[:10]
        ],
        "host_own_us_per_run (cProfile)": [
            {"function": f"{Path(f[0]).name}:{f[1]}:{f[2]}", "us": round(1e6 * v[2] / runs, 1)}
            for f, v in host_top
        ],
    }


def compile_record(engine: Engine) -> dict:
    """Where the load's seconds went: each decode graph's capture (its compile included: the
    first bucket's full, later ones recompiling with a symbolic row count), the prefill's
    compile (engine/prefill_compile.py; 0 where packed steps run eagerly) and inductor's disk
    cache (hits: an earlier process compiled the same graph; a second start should hit)."""
    from torch._dynamo.utils import compile_times, counters

    seconds = getattr(engine.runner, "capture_seconds", {})
    prefill = getattr(engine.runner, "prefill", None)  # (the compiled prefill's warm-up)
    cache = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    cache |= {k: v for k, v in counters["aot_autograd"].items() if "cache" in k}
    names, values = compile_times(repr="csv", aggregate=True)  # seconds per compile phase
    phases = sorted(zip(names, values, strict=True), key=lambda nv: -float(nv[1]))[:8]
    return {
        "capture_s": {f"{rows}x{width}": round(s, 2) for (rows, width), s in seconds.items()},
        "prefill_compile_s": round(getattr(prefill, "compile_seconds", 0.0), 2),
        "compile_cache": cache,
        "graphs_compiled": dict(counters["stats"]),  # unique_graphs: recompiles show here
        "compile_s_by_phase": {name: round(float(v), 2) for name, v in phases},
    }


def _p99(values: list[float]) -> float:
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def ttft(engine: Engine, request_id: str, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """Run one request alone to the end -> (seconds to its first token, its output tokens)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=new)
    start = time.perf_counter()
    request = engine.add(request_id, prompt, greedy, max_tokens=new, ignore_eos=True)
    first = None
    while engine.has_work:
        engine.step()
        if first is None and request.output:
            first = time.perf_counter() - start
    assert first is not None
    return first, list(request.output)


def agent_turns(
    engine: Engine, turns: int, first_tokens: int, turn_tokens: int, answer: int, seed: int
) -> list:
    """The agent shape (module docstring): one record per turn."""
    vocab = engine.loaded.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    conversation: list[int] = []
    records = []
    for turn in range(1, turns + 1):
        new = first_tokens if turn == 1 and first_tokens else turn_tokens
        conversation += torch.randint(10, vocab, (new,), generator=gen).tolist()
        prompt = list(conversation)
        hits_before = engine.pool.stats.hit_tokens
        warm, output = ttft(engine, f"turn-{turn}", prompt, answer)
        cached = engine.pool.stats.hit_tokens - hits_before
        # a first token of this turn's own (ids 10.. as the prompts'): no page of it is cached,
        # neither the conversation's nor an earlier turn's cold prompt's (with one first token for
        # every turn, turn N's cold prompt found turn N - 1's cached: it computed ~a turn)
        first = 10 + (prompt[0] - 10 + turn) % (vocab - 10)
        cold_hits = engine.pool.stats.hit_tokens
        cold, _ = ttft(engine, f"cold-{turn}", [first, *prompt[1:]], 1)
        cold_cached = engine.pool.stats.hit_tokens - cold_hits
        conversation += output
        records.append(
            {
                "turn": turn,
                "prompt_tokens": len(prompt),
                "cached_tokens": cached,
                "ttft_ms": round(1e3 * warm, 2),
                "cold_ttft_ms": round(1e3 * cold, 2),
                "cold_cached_tokens": cold_cached,  # 0: the cold prompt computed every token
                "ttft_ratio": round(warm / cold, 4),
            }
        )
    return records, conversation


def profile_turn(engine: Engine, conversation: list[int], turn_tokens: int, seed: int) -> dict:
    """Where a warm turn's first token goes: turns of `turn_tokens` new tokens after the whole
    `conversation` (its pages cached), each with new tokens of its own, under the profilers."""
    vocab = engine.loaded.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    count = iter(range(1000))

    def turn() -> None:
        extra = torch.randint(10, vocab, (turn_tokens,), generator=gen).tolist()
        ttft(engine, f"profiled-{next(count)}", conversation + extra, 1)

    turn()  # the shape's kernels warm
    return {"case": "serve-agent-profile", "prompt_tokens": len(conversation) + turn_tokens,
            **profile_runs(engine, turn, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--concurrency",
        help="concurrent streams, comma separated (default: 1,4,16,64; with --agent-turns: "
        "none, unless given: then the streams first, on the same engine)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument(
        "--gpu-fraction",
        type=float,
        default=1.0,
        help="share of the experts' base blobs in GPU slots (1: all pinned; less: the rest read "
        "from pinned host RAM, zero-copy)",
    )
    parser.add_argument(
        "--lookahead",
        default="on",
        choices=("on", "off"),
        help="launch the next decode step before the host handles this one's tokens",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="also profile this many decode steps per concurrency",
    )
    parser.add_argument(
        "--profile-turn",
        action="store_true",
        help="agent: after the turns, profile one more warm turn (where its TTFT goes)",
    )
    parser.add_argument("--agent-turns", type=int, default=0, help="the agent shape's turns")
    parser.add_argument(
        "--first-tokens",
        type=int,
        default=0,
        help="agent: the first turn's tokens (a system prompt and tools; 0: --turn-tokens)",
    )
    parser.add_argument("--turn-tokens", type=int, default=800, help="agent: new tokens a turn")
    parser.add_argument("--answer-tokens", type=int, default=200, help="agent: answer tokens")
    parser.add_argument(
        "--compile", default="on", choices=("on", "off"), help="torch.compile the decode step"
    )
    parser.add_argument(
        "--compile-prefill",
        default="on",
        choices=("on", "off"),
        help="torch.compile the packed (prefill) steps, where the engine does (every expert "
        "pinned, GQA families)",
    )
    parser.add_argument(
        "--native",
        default="on",
        choices=("on", "off"),
        help="on: the native model file where the shape's model_type has one (else the "
        "transformers class); off: the transformers class (the native-against-transformers "
        "comparison)",
    )
    args = parser.parse_args()
    if args.concurrency is not None:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    else:
        concurrencies = [] if args.agent_turns else [1, 4, 16, 64]
    info = run_info()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        config_dict = shape(args.shape, args.layers)
        if args.agent_turns:  # the conversation must fit the context (the bench shape's is cut)
            turns = args.agent_turns + 1  # (--profile's turn after them)
            needed = args.first_tokens + turns * (args.turn_tokens + args.answer_tokens)
            config_dict["max_position_embeddings"] = max(
                config_dict["max_position_embeddings"], needed
            )
        store = write_synthetic_store(Path(tmp) / "store", config_dict, "q2s", DEFAULT_STORE)
        blobs = sum(1 for k in Store(store).blobs if k[2] == "base")
        slots = max(1, round(args.gpu_fraction * blobs)) if args.gpu_fraction < 1 else 0
        config = EngineConfig(
            device=args.device,
            native=args.native == "on",
            compile_decode=args.compile == "on",
            compile_prefill=args.compile_prefill == "on",
            lookahead=args.lookahead == "on",
            expert_cache_slots=slots,
            host_memory="1TiB" if slots else "",
        )
        began = time.perf_counter()
        loaded = load_model(store, config)
        rows = max(concurrencies, default=1)
        pages = rows * -(-(args.prompt_tokens + args.new_tokens) // 16) + 16
        if args.agent_turns:  # the conversation's pages stay cached beside a cold copy
            longest = args.first_tokens + (args.agent_turns + 1) * (
                args.turn_tokens + args.answer_tokens
            )  # (the warm-up pass's pages are evicted first)
            pages = max(pages, 3 * -(-longest // 16) + 16)
        limits = EngineLimits(num_pages=pages, max_num_seqs=rows)
        engine = Engine(loaded, limits)
        load_s = time.perf_counter() - began  # load, compile and capture: until ready
        copy = copy_bandwidth() if args.device == "cuda" else None
        common = {
            **info,
            "shape": args.shape,
            "layers": args.layers,
            "experts": "q2s",
            "compile": args.compile,
            "compile_prefill": getattr(engine.runner, "prefill", None) is not None,
            "lookahead": args.lookahead,
            "path": decode_path(engine),
            "gpu_fraction": args.gpu_fraction,
            "zero_copy": loaded.runtime.zero_copy is not None,
            "load_s": round(load_s, 1),
            **compile_record(engine),
        }
        for concurrency in concurrencies:
            run_case(engine, concurrency, args.prompt_tokens, 8, seed=1)  # warm-up and capture
            record = run_case(engine, concurrency, args.prompt_tokens, args.new_tokens, seed=2)
            emit(
                {
                    **common,
                    "case": "serve-engine",
                    "warm_up_s": round(getattr(engine.runner, "warm_up_seconds", 0.0), 1),
                    **record,
                    "copy_GB/s": round(copy / 1e9, 1) if copy else None,
                }
            )
            if args.profile:
                emit(
                    {
                        **common,
                        **profile_steps(engine, concurrency, args.prompt_tokens, args.profile, 4),
                    }
                )

        if args.agent_turns:
            # the whole conversation once with other tokens first (discarded): every shape the
            # measured one runs (its chunks, the kernels' configs for them) is then warm, on
            # the warm side and the cold side alike
            shape_args = (args.agent_turns, args.first_tokens, args.turn_tokens, args.answer_tokens)
            agent_turns(engine, *shape_args, seed=2)
            records, conversation = agent_turns(engine, *shape_args, seed=3)
            for record in records:
                emit({**common, "case": "serve-agent", **record})
            if args.profile_turn:
                emit({**common, **profile_turn(engine, conversation, args.turn_tokens, 5)})


if __name__ == "__main__":
    main()
