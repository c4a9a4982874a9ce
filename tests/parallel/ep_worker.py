"""Test worker: greedy requests of different prompt lengths through the serving engine (prompt
chunks and decode rows mixed in steps), one JSON line of their tokens on stdout. Run as one
process, or as one rank of several with torchrun's variables set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), as tests/parallel/test_expert_parallel.py starts it.

    python tests/parallel/ep_worker.py STORE [--hotness FILE] [--spawn N] [--fail-rank R]
    python tests/parallel/ep_worker.py STORE --hang-rank R   (the combine's timeout)

--spawn N starts N ranks itself (launch.run's spawn path, as `moetier generate --gpus N`);
--fail-rank R: rank R raises at start; --hang-rank R: every rank joins the group, then rank R
sleeps while the others run one expert combine, which must fail with a clear error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("--hotness", default="")
    parser.add_argument("--spawn", type=int, default=0)  # 0: --gpus left out
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--raise-in-step", type=int, default=0, help="rank 0's Nth attention")
    parser.add_argument("--rank1-hotness", default=None, help="rank 1's own --expert-hotness")
    parser.add_argument("--atexit", action="store_true", help="say so if the teardown runs")
    return run(parser.parse_args(argv))


def hang(rank: int, hang_rank: int) -> int:
    """Every rank joins; `hang_rank` then sleeps, the others run a combine: its error."""
    from moetier.parallel.experts import Combine
    from moetier.parallel.group import join

    group = join("cpu")
    if rank == hang_rank:
        time.sleep(10)  # past the others' 3 s timeout, then away
        return 0
    began = time.perf_counter()
    try:
        Combine(group)(3, torch.zeros(2, 2, 4))
    except RuntimeError as err:
        print(json.dumps({"error": str(err), "seconds": time.perf_counter() - began}), flush=True)
        # out at once: the group's timed-out work is still queued in gloo, whose teardown at a
        # normal exit can abort the process ("terminate called without an active exception",
        # seen once in a loaded full suite) after the error was reported
        os._exit(0)
    return 1


def inject(attention, nth: int) -> None:
    """`attention`'s nth forward raises (rank 0 only: a simulated out-of-memory mid-step)."""
    real, calls = attention.forward, [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError("out of memory (simulated, rank 0 only)")
        return real(*args, **kwargs)

    attention.forward = forward


def run(args: argparse.Namespace) -> int:
    """The worker as a verb's run (launch.spawn calls it in each rank it starts)."""
    from moetier.config import EngineConfig
    from moetier.engine.engine import Engine, EngineLimits
    from moetier.engine.sampler import SamplingParams
    from moetier.parallel import launch

    rank = int(os.environ.get("RANK", "0"))
    if args.atexit:
        import atexit

        atexit.register(lambda: print("interpreter teardown", file=sys.stderr, flush=True))
    if args.hang_rank >= 0:
        return hang(rank, args.hang_rank)
    if rank == args.fail_rank and "WORLD_SIZE" in os.environ:
        raise ValueError(f"rank {rank} fails on purpose")
    torch.manual_seed(0)
    hotness = args.rank1_hotness if rank == 1 and args.rank1_hotness else args.hotness
    config = EngineConfig(device="cpu", expert_hotness=hotness, gpus=args.spawn)
    limits = EngineLimits(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=12)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 17, 2, 9))]

    def body(session: launch.Session) -> int:
        loaded = session.load_model(args.store, config, (limits.num_pages + 1) * limits.page_size)
        engine = Engine(loaded, limits)
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        if args.raise_in_step and session.leader is not None:
            inject(loaded.model.model.layers[1].self_attn, args.raise_in_step)
        requests = [engine.add(str(i), p, params, ignore_eos=True) for i, p in enumerate(prompts)]
        while engine.has_work:
            try:
                engine.step()
            except RuntimeError as err:  # as the server's engine loop: the step's requests fail
                print(f"step failed: {err}", file=sys.stderr, flush=True)
                for rid in list(engine.requests):
                    engine.abort(rid)
        runtime = loaded.runtime
        shard = runtime.shard
        resident = sorted({(k[0], k[1]) for k in runtime.residency._slots})
        print(json.dumps({
            "tokens": [list(r.output) for r in requests],
            "ranks": session.ranks,
            "forwards": session.leader.forwards if session.leader else 0,
            "combines": getattr(shard.combine, "calls", 0) if shard else 0,
            "owned": {str(k): v for k, v in shard.owned.items()} if shard else None,
            "resident": resident,
        }))  # fmt: skip
        return 0

    return launch.run(body, "ep_worker", args, config, args.store)


if __name__ == "__main__":
    from moetier.parallel.group import end_process

    sys.exit(end_process(main(sys.argv[1:])))
