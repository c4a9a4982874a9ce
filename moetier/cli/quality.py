"""`moetier quality STORE --reference HF_DIR --text FILE`: KL divergence and perplexity of a
store against the Hugging Face model's logits (llama-perplexity protocol); one JSON line.

With a gate rule (`--delta`, docs/gate.md) the line also gives the delta's bits per active
expert weight. `--write-sensitivity` measures the gate's per-(layer, expert) sensitivity table on
the text instead; `--write-hot F --trace NPZ` writes a static hot-set table from a routing trace;
`--write-act-sketch R` writes the act term's sketches of the store's delta planes (no reference
or text needed)."""

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
        "--reference", help="Hugging Face model directory (reference logits); required but with "
        "--write-act-sketch"
    )  # fmt: skip
    parser.add_argument("--text", help="UTF-8 text file to score; required as --reference")
    parser.add_argument(
        "--ctx",
        type=int,
        default=512,
        help="chunk length, 2 or more; the second half is scored (default: 512)",
    )
    parser.add_argument(
        "--chunks", type=int, default=0, help="score at most this many chunks (default: 0 = all)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=4, help="chunks per forward, 1 or more (default: 4)"
    )
    parser.add_argument(
        "--write-sensitivity",
        action="store_true",
        help="measure the gate's sensitivity table on --text (per layer: the KLD the delta on "
        "that layer alone removes, shared among its experts by their delta's output error) and "
        "write it (--table-out, default STORE/gate_sensitivity.json)",
    )
    parser.add_argument(
        "--write-hot",
        type=float,
        default=None,
        metavar="F",
        help="write a static hot-set table: per layer the most used experts of --trace whose "
        "share of its pairs is nearest F (--table-out, default STORE/gate_hot.json)",
    )
    parser.add_argument(
        "--write-act-sketch",
        type=int,
        default=None,
        metavar="R",
        help="write the gate's act sketches: per (layer, expert) the top R singular directions "
        "of the down projection's delta, scaled by their singular values, from the store's "
        "delta planes (--table-out, default STORE/gate_act.safetensors; 16 is the studied rank)",
    )
    parser.add_argument(
        "--act-sketch-gate-up",
        action="store_true",
        help="with --write-act-sketch: the gate_up delta's top R directions too (the act term "
        "then adds ||S_gu x||^2)",
    )
    parser.add_argument("--trace", help="routing trace .npz (expert_ids [layers, tokens, k])")
    parser.add_argument(
        "--table-out", help="where --write-sensitivity / --write-hot / --write-act-sketch write"
    )
    parser.add_argument("--seed", type=int, default=0, help="torch seed (the random gate term)")
    add_dataclass_arguments(parser, EngineConfig, "engine")
    for action in parser._actions:
        if action.dest == "native":  # refused when given (run): None tells given from not
            action.default = None
            action.help = (
                "not taken: quality scores the store through the transformers model class, "
                "whose forward gives every position's logits (--no-native is the default)"
            )


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ValueError for flags quality cannot take (cli/main.py calls it once they are parsed): a
    --ctx under 2, a negative --chunks, a --batch-size under 1, --native."""
    if args.ctx < 2:
        raise ValueError(
            f"--ctx {args.ctx}: a chunk needs 2 tokens or more (its second half is scored)"
        )
    if args.chunks < 0:
        raise ValueError(f"--chunks {args.chunks}: give 0 (every chunk) or how many to score")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: give 1 or more chunks per forward")
    if args.native:
        raise ValueError(
            "quality does not take --native: it scores the store through the transformers model "
            "class, whose forward gives every position's logits (the native model files are "
            "checked against the same class in tests/models/test_native.py); drop the flag"
        )
    native_only = dataclass_from_args(EngineConfig, args).native_only_flags()
    if native_only:
        raise ValueError(
            f"{', '.join(native_only)}: quality scores the store through the transformers model "
            "class, and only the native model files read these flags: drop them"
        )


def check_reference(store: str, reference: str) -> None:
    """ValueError where `reference` is not a Hugging Face model directory of the store's model
    (engine/quality.py `reference_mismatch`): the logits could not be compared."""
    from moetier.engine.quality import reference_mismatch
    from moetier.quant.store import Store

    config = Path(reference) / "config.json"
    if not config.is_file():
        raise ValueError(
            f"--reference {reference}: no config.json there; give the Hugging Face model "
            "directory the store was converted from"
        )
    differs = reference_mismatch(Store(store).hf_config, json.loads(config.read_text()))
    if differs:
        raise ValueError(
            f"--reference {reference} is not the store's model ({differs}): give the "
            "checkpoint the store was converted from"
        )


def check_tokenizers(store: str, reference: str) -> None:
    """ValueError where the reference directory has a tokenizer whose vocabulary is not the
    store's: the text is tokenised once, by the store's tokenizer, for both models."""
    from moetier.quant.convert import tokenizer_files

    if not (tokenizer_files(Path(reference)) and tokenizer_files(Path(store))):
        return
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(reference).get_vocab()
    ours = AutoTokenizer.from_pretrained(store).get_vocab()
    if theirs != ours:
        moved = sum(1 for token, i in ours.items() if theirs.get(token) != i)
        raise ValueError(
            f"--reference {reference}: its tokenizer is not the store's ({moved} of the store's "
            f"{len(ours)} tokens have another id or none there): give the checkpoint the store "
            "was converted from"
        )


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from moetier.engine.quality import chunks, compare
    from moetier.loader.load import load_model

    engine_config = dataclass_from_args(EngineConfig, args)
    torch.manual_seed(args.seed)
    if args.write_act_sketch is not None:
        return _write_act_sketch(args)
    if args.reference is None or args.text is None:
        raise SystemExit("moetier quality needs --reference HF_DIR and --text FILE")
    if args.write_hot is not None:
        return _write_hot(args)
    check_reference(args.store, args.reference)
    check_tokenizers(args.store, args.reference)
    text = Path(args.text).read_text(encoding="utf-8")
    if args.write_sensitivity:  # measured with the delta plane; the rule given is not used
        engine_config = EngineConfig(**{**engine_config.__dict__, "delta": "all"})
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
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    token_chunks = chunks(ids, args.ctx, args.chunks)

    if args.write_sensitivity:
        from moetier.cli.gate_sensitivity import measure_sensitivity

        return measure_sensitivity(loaded, reference, token_chunks, args)

    gate = loaded.runtime.gate
    two_pass = gate is not None and "confidence" in gate.rule.terms()

    def ours(batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(loaded.device)
        if two_pass:  # the previous position's distribution, as a decode step would have it:
            # a first pass (confidence unknown) gives each position's top probability, which
            # the gated pass reads one position later
            assert gate is not None
            gate.confidence = None
            first = loaded.model(batch).logits.float().softmax(-1).amax(-1)  # [B, S]
            conf = torch.cat([torch.ones_like(first[:, :1]), first[:, :-1]], dim=1)
            gate.confidence = conf.flatten()
            try:
                return loaded.model(batch).logits
            finally:
                gate.confidence = None
        return loaded.model(batch).logits

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
        "delta_bits_per_active_weight": round(
            loaded.runtime.delta_pairs
            / max(1, loaded.runtime.pairs)
            * (store.plane_bits_per_weight("delta") if store.has_plane("delta") else 0.0),
            4,
        ),
        **{k: round(v, 6) if isinstance(v, float) else v for k, v in report.to_dict().items()},
        "commit": _commit(),
    }
    print(json.dumps(line))
    return 0


def _write_hot(args: argparse.Namespace) -> int:
    """--write-hot F --trace NPZ: the static hot set (gate_hot.json)."""
    import numpy as np
    import torch

    from moetier.gate.tables import hot_set, write_table
    from moetier.quant.store import Store

    if not args.trace:
        raise SystemExit("--write-hot needs --trace (a routing trace .npz with expert_ids)")
    store = Store(args.store)
    ids = torch.from_numpy(np.load(args.trace)["expert_ids"].astype("int64"))
    layers = store.moe_layers
    if ids.shape[0] != len(layers):
        raise SystemExit(f"the trace has {ids.shape[0]} layers, the store {len(layers)} MoE layers")
    table = hot_set(ids, store.model_config.num_experts, args.write_hot)
    out = Path(args.table_out) if args.table_out else store.path / "gate_hot.json"
    how = f"most used experts of {Path(args.trace).name}, nearest {args.write_hot} of pairs"
    write_table(out, "hot", {layers[i]: row for i, row in table.items()}, how)
    print(json.dumps({"table": str(out), "kind": "hot", "fraction": args.write_hot,
                      "experts": {layers[i]: int(sum(r)) for i, r in table.items()}}))  # fmt: skip
    return 0


def _write_act_sketch(args: argparse.Namespace) -> int:
    """--write-act-sketch R: the act term's sketches of the delta planes (gate_act.safetensors)."""
    from tqdm import tqdm

    from moetier.gate.sketches import DEFAULT_FILE, compute_sketches, write_sketches
    from moetier.quant.store import Store

    store = Store(args.store)
    rank = args.write_act_sketch
    try:
        tensors = compute_sketches(
            store,
            rank,
            gate_up=args.act_sketch_gate_up,
            progress=lambda jobs: tqdm(jobs, desc="sketches", unit="expert"),
        )
    except ValueError as err:
        raise SystemExit(str(err)) from None
    out = Path(args.table_out) if args.table_out else store.path / DEFAULT_FILE
    parts = "down and gate_up deltas" if args.act_sketch_gate_up else "down delta"
    how = f"top {rank} right-singular directions x singular values of each expert's {parts}"
    write_sketches(out, tensors, rank, how)
    print(json.dumps({"sketches": str(out), "kind": "act", "rank": rank,
                      "gate_up": args.act_sketch_gate_up, "layers": len(store.moe_layers),
                      "bytes": sum(t.numel() * 4 for t in tensors.values())}))  # fmt: skip
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
