"""`moetier bench [STORE | --shape NAME [--layers N]] [--batch 1,8] [--prompt-tokens N]
[--new-tokens N] [--json] [engine flags]`: prefill and decode speed of this machine, per batch
size, next to the floor its measured link speeds allow (engine/benchmark.py says how)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetier.cli.common import add_model_arguments
from moetier.config import DEFAULT_STORE, EngineConfig

# (heading, JSON field, width, format) of the table's columns
COLUMNS = (
    ("batch", "batch", 5, "{}"),
    ("prefill tok/s", "prefill_tok_s", 13, "{:.1f}"),
    ("TTFT ms", "ttft_ms", 9, "{:.1f}"),
    ("decode tok/s", "decode_tok_s", 12, "{:.1f}"),
    ("ms/step", "ms_per_step", 9, "{:.2f}"),
    ("hit rate", "hit_rate", 8, "{:.3f}"),
    ("gpu MB/tok", "gpu", 10, "{:.3f}"),
    ("host MB/tok", "host", 11, "{:.3f}"),
    ("disk MB/tok", "disk", 11, "{:.3f}"),
    ("floor ms", "floor_ms_per_step", 9, "{:.3f}"),
    ("x floor", "ratio_to_floor", 8, "{:.1f}"),
)

# the links' names in the table's header: on CPU, host memcpys stand in for the GPU's links
LINK_NAMES = {
    True: {"hbm": "GPU copy", "h2d": "pinned H2D", "zero_copy": "zero-copy read", "disk": "disk"},
    False: {"hbm": "memory copy", "h2d": "host copy", "disk": "disk"},
}

# (flag, default, help) of the counts
INT_FLAGS = (
    ("--prompt-tokens", 128, "prompt tokens per row"),
    ("--new-tokens", 64, "tokens generated per row; the first comes from the prefill"),
    (
        "--warmup",
        1,
        "untimed runs of each case before the timed one: they compile kernels, capture CUDA "
        "graphs and fill the expert cache",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, sampling=False)
    bench = parser.add_argument_group("bench")
    from moetier.quant.synthetic import SHAPES

    bench.add_argument(
        "--shape",
        help="measure a synthetic store of this shape (random q2s weights, written to a "
        f"temporary folder first) instead of STORE: {' or '.join(SHAPES)}",
    )
    bench.add_argument(
        "--layers", type=int, help="with --shape: this many decoder layers (default: the shape's)"
    )
    bench.add_argument(
        "--dense",
        default="bf16",
        metavar="FORMAT",
        help="with --shape: the dense weights' format (bf16, fp8, int4, int4-gN, nvfp4), as "
        "`moetier convert --dense` writes it (default: bf16)",
    )
    bench.add_argument(
        "--delta-plane",
        choices=["nvfp4"],
        help="with --shape: a delta plane of random NVFP4 blobs too, which --delta applies "
        "(the confidence gate's steps)",
    )
    bench.add_argument(
        "--batch",
        default="1",
        help="batch sizes, comma separated: one case each, its rows decoded together (default: 1)",
    )
    for flag, default, help_text in INT_FLAGS:
        bench.add_argument(
            flag, type=int, default=default, help=f"{help_text} (default: {default})"
        )
    bench.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="speculative decoding with the model's MTP layer (--mtp-file for a model without "
        "one): drafts per step; the JSON gives the acceptance by position (default: 0, off)",
    )
    bench.add_argument(
        "--speculative-policy",
        choices=("always", "auto"),
        default="always",
        help="with --speculative-tokens: always draft (what drafting costs), or auto: draft at a "
        "batch size only while the engine's own measured steps say it pays, as `moetier serve` "
        "does (default: always)",
    )
    bench.add_argument(
        "--mtp-replay",
        metavar="RATES",
        help="with --speculative-tokens on random weights (--shape: the synthetic store gets an "
        "MTP layer): keep drafts at these acceptance rates by position (e.g. 0.5,0.22, as "
        "bench/speculative.py measures them) instead of by the model's choices: timing only",
    )
    bench.add_argument(
        "--json",
        action="store_true",
        help="one JSON line per case on stdout (commit, device, versions, config, figures, "
        "floor) instead of the table",
    )


def run(args: argparse.Namespace) -> int:
    from moetier.cli.flags import dataclass_from_args
    from moetier.parallel import launch

    cases = _cases(args)
    engine_config = dataclass_from_args(EngineConfig, args)
    engine_config.check_device_and_dtype()  # before a synthetic store is written
    if args.speculative_tokens > 0:  # drafts come from the model's MTP layer
        engine_config = dataclasses.replace(engine_config, mtp=True)
    limits = _limits(cases, args.speculative_tokens, args.speculative_policy)
    with _terminated_as_interrupted() as stopped:
        try:
            with _store(args) as store_path:
                # --gpus N: N ranks, the benchmark on rank 0 (moetier/parallel/launch.py); ranks
                # this process spawns read the synthetic store written here
                env = {SHARED_STORE_ENV: str(store_path)} if args.shape else {}
                return launch.run(
                    lambda session: _bench(args, cases, engine_config, limits, store_path, session),
                    __name__, args, engine_config, store_path, limits.num_pages * limits.page_size,
                    env,
                )  # fmt: skip
        except KeyboardInterrupt:
            if stopped:  # SIGTERM: its status, the synthetic store removed on the way out
                return 128 + stopped[0]
            raise


@contextlib.contextmanager
def _terminated_as_interrupted() -> Iterator[list[int]]:
    """SIGTERM handled as Ctrl-C while the body runs, so that a synthetic store's temporary
    folder (hundreds of MB) is removed on the way out, as after SIGINT, instead of being left
    behind by the default action; the list yields the signal once it came. Repeats are ignored
    while the folder is removed. Outside the main thread (no handler can be set) a no-op."""
    import signal
    import threading

    stopped: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if not stopped:
            stopped.append(signum)
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGTERM, previous)


# a synthetic store written by the process that spawned this rank (bench --shape --gpus N)
SHARED_STORE_ENV = "MOETIER_BENCH_STORE"


def _bench(
    args: argparse.Namespace,
    cases: list[Any],
    engine_config: EngineConfig,
    limits: Any,
    store_path: Path,
    session: Any,
) -> int:
    from moetier.core.provenance import run_info
    from moetier.engine.benchmark import decode_path
    from moetier.engine.engine import Engine

    device = engine_config.resolved_device().split(":")[0]
    _check_context(cases, store_path)
    speeds, links = _links(device, store_path)
    _say(f"loading {store_path.name}")
    loaded = session.load_model(store_path, engine_config, limits.num_pages * limits.page_size)
    engine = Engine(loaded, limits)  # compiles and captures its decode steps now
    if args.mtp_replay:
        drafter = getattr(engine.runner, "drafter", None)
        if drafter is None:
            raise ValueError("--mtp-replay goes with --speculative-tokens")
        drafter.replay([float(v) for v in args.mtp_replay.split(",")])
    info = run_info()
    config = {
        "store": loaded.name,
        "shape": args.shape,
        "dense_formats": sorted({f.name for f in loaded.store.dense_formats.values()}),
        "model_type": loaded.model_config.model_type,
        "moe_layers": len(loaded.store.moe_layers),
        "experts_format": sorted(loaded.store.formats),
        "device_kind": loaded.device.type,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "path": decode_path(engine),
        "gpus": session.ranks,
        "engine": _changed(engine_config),
        **({"speculative_policy": args.speculative_policy} if args.speculative_tokens else {}),
        "sampling": "greedy",
        "prompt": "random token ids",
    }
    if not args.json:
        _header(info, config, links, args)
    progress = sys.stderr.isatty()
    for case in cases:
        record = _timed(engine, case, speeds, args.warmup, progress)
        if args.json:
            print(json.dumps({**info, "case": "bench", **config, **record, **links}))
        else:
            print(_row(record))
        sys.stdout.flush()
    return 0


def _check_context(cases: list[Any], store_path: Path) -> None:
    """ValueError, in bench's flags, where a row's prompt and new tokens do not fit the model's
    context (config.json's max_position_embeddings, a composite config's text model's), before
    anything is measured or loaded; the engine's own error names the server's max_tokens."""
    hf = json.loads((store_path / "config.json").read_text())
    context = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    case = cases[0]  # every case has the same counts
    if context and case.prompt_tokens + case.new_tokens > int(context):
        raise ValueError(
            f"--prompt-tokens {case.prompt_tokens} and --new-tokens {case.new_tokens} make rows "
            f"of {case.prompt_tokens + case.new_tokens} tokens, and this model's context holds "
            f"{context}: lower them so that they add up to {context} or fewer"
        )


def _links(device: str, store_path: Path) -> tuple[Any, dict[str, Any]]:
    """The link speeds measured now (before the model takes the memory the measurements need)
    and their JSON fields; (None, a note) where the measurement failed (e.g. out of GPU memory:
    the figures still come, without a floor)."""
    from moetier.quant.store import Store
    from moetier.residency.links import fastest, link_gbps, measure_links, memory_links

    _say(f"measuring this machine's links ({device})")
    store = Store(store_path)
    try:
        speeds = measure_links(device, store)
        speeds = fastest(speeds, memory_links(device, speeds.disk))
    except RuntimeError as err:
        return None, {"floor_note": f"no floor: measuring the links failed: {err}"}
    finally:
        store.close()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()  # the measurements' buffers, back for the model
    return speeds, link_gbps(speeds)


def _limits(cases: list[Any], speculative: int = 0, policy: str = "always") -> Any:
    """The engine's limits for these cases: KV pages for the largest case's rows (and their
    drafts), as many rows a step, and room to read a case's prompts in few steps."""
    from moetier.engine.engine import EngineLimits

    page = EngineLimits().page_size
    pages = max(c.rows * -(-(c.prompt_tokens + c.new_tokens + speculative) // page) for c in cases)
    rows = max(c.rows for c in cases)
    tokens = max(EngineLimits().max_num_batched_tokens, max(c.prompt_tokens for c in cases))
    return EngineLimits(num_pages=pages, max_num_seqs=rows, max_num_batched_tokens=tokens,
                        speculative_tokens=speculative, speculative_policy=policy)  # fmt: skip


def _timed(engine: Any, case: Any, speeds: Any, warmup: int, progress: bool) -> dict[str, Any]:
    """run_case with a progress bar on stderr (a terminal only) over its steps."""
    from tqdm import tqdm

    from moetier.engine.benchmark import run_case

    total = (warmup + 1) * case.new_tokens  # steps, when the prompts take one
    with tqdm(total=total, desc=f"batch {case.rows}", unit="step", leave=False,
              disable=not progress) as bar:  # fmt: skip
        return run_case(engine, case, speeds, warmup, on_step=bar.update)


def _cases(args: argparse.Namespace) -> list[Any]:
    from moetier.engine.benchmark import BenchCase

    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise ValueError(f"--batch {args.batch!r}: batch sizes of 1 or more, e.g. 1,8,32")
    if args.prompt_tokens < 1:
        raise ValueError("--prompt-tokens must be at least 1")
    if args.new_tokens < 2:
        raise ValueError(
            "--new-tokens must be at least 2: the first comes from the prefill, the decode "
            "speed from the rest"
        )
    if args.warmup < 0:
        raise ValueError("--warmup must be 0 or more")
    if args.layers is not None and args.shape is None:
        raise ValueError("--layers goes with --shape (a synthetic store's depth)")
    if args.dense != "bf16" and args.shape is None:
        raise ValueError("--dense goes with --shape (convert a STORE with moetier convert --dense)")
    if args.shape is not None and Path(args.store) != DEFAULT_STORE:
        raise ValueError("give a STORE or --shape, not both")
    return [BenchCase(b, args.prompt_tokens, args.new_tokens) for b in batches]


@contextlib.contextmanager
def _store(args: argparse.Namespace) -> Iterator[Path]:
    """The store to measure: STORE, or with --shape a synthetic one in a temporary folder
    (removed afterwards), after saying how big it is and checking there is room."""
    if args.shape is None:
        yield Path(args.store)
        return
    if os.environ.get(SHARED_STORE_ENV):  # a rank of --gpus N: the spawning process wrote it
        yield Path(os.environ[SHARED_STORE_ENV])
        return
    from moetier.quant.synthetic import shape, synthetic_store_bytes, write_synthetic_store

    hf_config = shape(args.shape, args.layers)
    size = synthetic_store_bytes(hf_config, delta=args.delta_plane)
    with tempfile.TemporaryDirectory(prefix="moetier-bench-") as tmp:
        free = shutil.disk_usage(tmp).free
        if size > free:
            raise ValueError(
                f"the {args.shape} store needs {size / 1e9:.2f} GB and {tmp} has "
                f"{free / 1e9:.2f} GB free: point TMPDIR at a larger disk or give fewer --layers"
            )
        from moetier.config import ModelConfig

        layers = hf_config["num_hidden_layers"]
        experts = ModelConfig.from_hf(hf_config).num_experts
        _say(
            f"writing a synthetic {args.shape} store ({layers} layers x {experts} experts, "
            f"random q2s weights, {_size(size)}) to {tmp} (removed after the run)"
        )
        path = Path(tmp) / args.shape
        from moetier.quant.dense_formats import DensePolicy

        write_synthetic_store(
            path,
            hf_config,
            "q2s",
            DEFAULT_STORE,
            progress=sys.stderr.isatty(),
            dense=DensePolicy.parse(args.dense),
            delta=args.delta_plane,
            mtp=args.speculative_tokens > 0,
        )
        yield path


def _changed(config: EngineConfig) -> dict[str, Any]:
    """The engine settings that differ from their defaults (the flags given)."""
    default = EngineConfig()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(default, f.name)
    }


def _header(
    info: dict[str, Any], config: dict[str, Any], links: dict[str, Any], args: argparse.Namespace
) -> None:
    formats = ", ".join(config["experts_format"])
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in config["engine"].items())
    print(
        f"{config['store']}: {config['model_type']}, {config['moe_layers']} MoE layers, "
        f"{formats} experts; {config['device_kind']} {config['dtype']}, {config['path']}"
        + (f" ({flags})" if flags else "")
    )
    versions = ", ".join(f"{k} {info[k]}" for k in ("torch", "triton", "transformers") if k in info)
    print(f"device: {info['device']}; commit {info['commit']}; {versions}")
    if "floor_note" in links:
        print(links["floor_note"])
    else:
        names = LINK_NAMES[config["device_kind"] == "cuda"]
        rates = ", ".join(f"{name} {links[k + '_GB/s']} GB/s" for k, name in names.items())
        print(f"links measured now: {rates}")
        if config["device_kind"] != "cuda":
            print(
                "(on CPU the experts run through the torch reference kernels, not tuned for speed)"
            )
    runs = f"{args.warmup} untimed run" + ("" if args.warmup == 1 else "s")
    print(
        f"{args.prompt_tokens} prompt tokens and {args.new_tokens} new tokens a row, greedy; "
        f"warm-up: {runs} of each case first (kernels, CUDA graphs, expert cache)"
    )
    print("  ".join(f"{title:>{width}}" for title, _, width, _ in COLUMNS))


def _row(record: dict[str, Any]) -> str:
    values = {**record, **{k: v / 1e6 for k, v in record["bytes_per_token"].items()}}
    cells = []
    for _, key, width, fmt in COLUMNS:
        value = values.get(key)
        cells.append(f"{'-' if value is None else fmt.format(value):>{width}}")
    return "  ".join(cells)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _say(message: str) -> None:
    print(f"moetier bench: {message}", file=sys.stderr, flush=True)
