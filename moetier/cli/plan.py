"""`moetier plan STORE --gpu-memory 24GiB [--host-memory 64GiB]`: what would go where; or
`moetier plan --shape NAME [--dense auto]` for a model not converted, from its config.json
alone; `moetier plan --dense-table`: docs/residency.md's table of `--dense auto` on the models
of issue #52.

`moetier plan MODEL --gpu-memory .. --host-memory .. --predict [--disk DIR] [--json]
[--write-recipe PATH]`: measures this machine's links (cli/plan_links.py), predicts prefill and
decode tok/s at batch 1 and 16 for each candidate configuration (residency/speed.py), prints
the best and writes it as a recipe (cli/recipes.py); MODEL: a shape name, a config.json, or a
checkpoint or store folder holding one."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetier.config import DEFAULT_STORE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moetier.quant.synthetic import SHAPES

    parser.add_argument(
        "store",
        nargs="?",
        default=str(DEFAULT_STORE),
        metavar="MODEL",
        help="a moetier store; with --predict also a shape name, a config.json, or a checkpoint "
        "folder",
    )
    parser.add_argument(
        "--shape",
        help=f"plan the whole model of this shape instead of a STORE ({', '.join(SHAPES)}), or "
        "of a config.json given by path: from the config alone, no weights",
    )
    parser.add_argument(
        "--experts",
        default=None,
        choices=("q2s", "bfloat16"),
        help="with --shape, a config.json or a checkpoint: the experts' stored format (default: "
        "q2s); a store's are those it was converted to",
    )
    parser.add_argument(
        "--dense",
        default=None,
        metavar="FORMAT",
        help="with --shape: the dense weights' format as `moetier convert --dense` writes it "
        "(bf16, fp8, int4, int4-gN, nvfp4), or auto: the largest precision (bf16 > fp8 > int4 > "
        "nvfp4) whose plan keeps at least one token's routed experts (MoE layers x top-k) in "
        "GPU slots besides staging (default: bf16; with --predict: every one is a candidate)",
    )
    parser.add_argument(
        "--dense-override",
        action="append",
        default=[],
        metavar="CLASS=FORMAT",
        help="with --shape: another dense format for one class, as `moetier convert`",
    )
    parser.add_argument(
        "--dense-table",
        action="store_true",
        help="print docs/residency.md's table: --dense auto for DeepSeek-V3, Kimi-K2, GLM-5, "
        "DeepSeek-V4-Flash and Qwen3-235B-A22B on the cards of issue #52",
    )
    parser.add_argument(
        "--gpu-memory", help="GPU budget, e.g. 24GiB (required but with --dense-table)"
    )
    parser.add_argument("--host-memory", default="0", help="pinned host RAM budget, e.g. 64GiB")
    parser.add_argument("--max-context", type=int, default=4096, help="KV cache tokens per row")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="expert parallel over this many GPUs (as generate/serve/bench --gpus): the budgets "
        "are each GPU's, which holds the dense part, the KV cache and its share of the experts",
    )
    parser.add_argument(
        "--zero-copy-stage",
        type=int,
        default=3,
        help="staging slots per MoE layer in zero-copy decode (as generate/serve; 0 = off)",
    )

    parser.add_argument(
        "--embeddings",
        choices=("gpu", "host"),
        default="gpu",
        help="where the embedding table lives (as generate/serve; host: pinned host RAM)",
    )
    predict = parser.add_argument_group("prediction and recipes (docs/recipes.md)")
    predict.add_argument(
        "--predict",
        action="store_true",
        help="measure this machine's links and predict prefill and decode tok/s at batch 1 and "
        "16 of each candidate configuration (dense format, embedding table's place); print the "
        "best (implied by --disk, --json and --write-recipe)",
    )
    predict.add_argument(
        "--disk", metavar="DIR", help="measure O_DIRECT reads of a temporary file in DIR"
    )
    predict.add_argument("--json", action="store_true", help="the prediction as one JSON object")
    predict.add_argument(
        "--write-recipe", metavar="PATH", help="write the best configuration as a recipe"
    )
    predict.add_argument(
        "--model-id", help="the recipe's model (Hugging Face id; default: the shape's known id)"
    )
    predict.add_argument(
        "--parser", help="the recipe's tool/reasoning parser (default: by the model's type)"
    )


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ValueError for values the plan cannot mean (cli/main.py calls it once the flags are
    parsed): --batch or --max-context under 1, a negative --zero-copy-stage, --gpus under 1,
    and --experts beside a store, whose expert format its conversion fixed."""
    for flag, value, least in (
        ("--batch", args.batch, 1),
        ("--max-context", args.max_context, 1),
        ("--zero-copy-stage", args.zero_copy_stage, 0),
        ("--gpus", args.gpus, 1),
    ):
        if value < least:
            raise ValueError(f"{flag} {value}: give {least} or more")
    model = Path(args.store)
    if args.experts is not None and args.shape is None and (model / "experts.json").is_file():
        raise ValueError(
            "--experts applies with --shape, a config.json or a checkpoint: a store's experts "
            "are in the format `moetier convert --experts` wrote"
        )


def run(args: argparse.Namespace) -> int:
    from moetier.residency.planner import parse_bytes, plan

    args.experts = args.experts or "q2s"

    if args.dense_table:
        print(dense_table())
        return 0
    if args.gpu_memory is None:
        raise ValueError("--gpu-memory is required (e.g. --gpu-memory 24GiB)")
    if args.shape is None and _is_shape_name(args.store):
        args.shape, args.store = args.store, str(DEFAULT_STORE)
    if args.write_recipe and Path(args.write_recipe).suffix not in (".yaml", ".yml"):
        raise ValueError(
            f"--write-recipe {args.write_recipe}: name the file NAME.yaml (serve --recipe takes "
            "a path ending in .yaml or .yml, else a shipped recipe's name)"
        )
    if args.predict or args.disk or args.json or args.write_recipe:
        if args.gpus != 1:
            raise ValueError(
                "--predict models one GPU's links; with --gpus N plan without it (each GPU's "
                "split) or measure with `moetier bench --gpus N`"
            )
        return _predict(args)
    budgets = dict(
        gpu_memory=parse_bytes(args.gpu_memory),
        host_memory=parse_bytes(args.host_memory),
        max_context=args.max_context,
        batch=args.batch,
        zero_copy_stage=args.zero_copy_stage,
        embeddings_host=args.embeddings == "host",
    )
    if args.gpus != 1:
        budgets["ranks"] = args.gpus
    if args.shape is not None:
        if Path(args.store) != DEFAULT_STORE:
            raise ValueError("give a STORE or --shape, not both")
        hf_config = _shape_config(args.shape)
        print(f"{args.shape}: {_describe(hf_config, args.experts)}")
        result = _plan_dense(hf_config, args, budgets)
    else:
        if args.dense not in (None, "bf16") or args.dense_override:
            raise ValueError(
                "--dense applies with --shape: a store's dense formats were chosen by "
                "`moetier convert --dense`"
            )
        from moetier.quant.store import Store

        result = plan(Store(args.store), **budgets)
    print(result.render())
    return 0


def _plan_dense(hf_config: dict, args: argparse.Namespace, budgets: dict):  # type: ignore[no-untyped-def, type-arg]
    """plan_shape under --dense (auto: dense_choice picks; a line says what and why); an
    explicit format whose dense part does not fit is refused naming the option that would."""
    from moetier.quant.dense_formats import DensePolicy
    from moetier.residency import dense_choice
    from moetier.residency.planner import plan_shape

    if args.dense == "auto":
        choice = dense_choice.choose_dense(
            hf_config, overrides=args.dense_override, experts=args.experts, **budgets
        )
        print(choice.summary())
        return choice.plan
    policy = DensePolicy.parse(args.dense or "bf16", args.dense_override)
    try:
        return plan_shape(hf_config, experts=args.experts, dense=policy, **budgets)
    except ValueError as err:
        other = dense_choice.suggest(hf_config, args.dense_override, args.experts, **budgets)
        raise ValueError(f"{err}. {other}" if other else str(err)) from None


# issue #52's models and cards: (shape, --gpu-memory, --host-memory)
DENSE_TABLE_CASES = (
    ("deepseek-v3", "24GiB", "512GiB"),
    ("kimi-k2", "24GiB", "512GiB"),
    ("glm-5", "32GiB", "512GiB"),
    ("deepseek-v4-flash", "24GiB", "128GiB"),
    ("qwen3-235b-a22b", "24GiB", "128GiB"),
)


def dense_table() -> str:
    """The markdown table of `--dense auto` on DENSE_TABLE_CASES (q2s experts, 4096 tokens of
    KV, --zero-copy-stage 3, the embedding table on the GPU; the last column with it in host
    RAM)."""
    from moetier.config import ModelConfig
    from moetier.quant.synthetic import shape
    from moetier.residency import dense_choice
    from moetier.residency.planner import parse_bytes

    mib = 2**20
    rows = [
        "| model | GPU + host budget | --dense auto chose | larger ones refused (slots left) | "
        "dense on GPU | KV + workspace | expert slots: cached + staging of all (one token's) | "
        "expert blobs in host RAM | with --embeddings host |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, gpu, host in DENSE_TABLE_CASES:
        config = shape(name)
        cfg = ModelConfig.from_hf(config)
        budgets: dict[str, Any] = dict(host_memory=parse_bytes(host), zero_copy_stage=3)
        choice = dense_choice.choose_dense(config, parse_bytes(gpu), **budgets)
        on_host = dense_choice.choose_dense(
            config, parse_bytes(gpu), embeddings_host=True, **budgets
        )
        p = choice.plan
        refused = ", ".join(_refused_cell(c) for c in choice.refused) or "none"
        rows.append(
            f"| {name} ({cfg.num_experts} experts, top-{cfg.top_k}) | {gpu} + {host} | "
            f"**{choice.kind}** | {refused} | {p.dense_bytes / mib:,.0f} MiB | "
            f"{p.kv_bytes / mib:,.0f} + {p.workspace_bytes / mib:,.0f} MiB | "
            f"{dense_choice.cached_slots(p):,} + {p.staging} staging of {p.base_blobs:,} "
            f"({dense_choice.needed_slots(p)}) | {p.host_blobs:,} of "
            f"{p.base_blobs - p.gpu_base_slots:,} ({p.host_blobs * p.slot_bytes / 2**30:,.1f} "
            f"GiB) | {on_host.kind}, {dense_choice.cached_slots(on_host.plan):,} slots |"
        )
    return "\n".join(rows)


def _refused_cell(c) -> str:  # type: ignore[no-untyped-def]
    if c.plan is None:
        return f"{c.kind} (dense + KV + workspace over the card)"
    from moetier.residency.dense_choice import cached_slots

    return f"{c.kind} ({cached_slots(c.plan):,} slots)"


def _shape_config(name: str) -> dict:  # type: ignore[type-arg]
    """A named shape (quant/synthetic.SHAPES) or a config.json path."""
    import json

    from moetier.quant.synthetic import SHAPES, shape

    if name not in SHAPES and Path(name).is_file():
        config: dict = json.loads(Path(name).read_text())  # type: ignore[type-arg]
        config.pop("quantization_config", None)  # the store's formats are moetier's own
        return config
    return shape(name)


def _describe(hf_config: dict, experts: str) -> str:  # type: ignore[type-arg]
    from moetier.config import ModelConfig

    cfg = ModelConfig.from_hf(hf_config)
    return (
        f"{cfg.model_type}, {cfg.num_layers} layers, {cfg.num_experts} experts of "
        f"{cfg.hidden_size}x{cfg.expert_intermediate_size}, top-{cfg.top_k}, {experts} experts "
        "(planned from the config alone)"
    )


def _is_shape_name(name: str) -> bool:
    from moetier.quant.synthetic import SHAPES

    return name in SHAPES and not Path(name).exists()


def _model_config(args: argparse.Namespace) -> tuple[dict, str]:  # type: ignore[type-arg]
    """(config, what it is) of MODEL for --predict: a shape, a config.json, or a folder
    holding one (a checkpoint or a store)."""
    if args.shape is not None:
        return _shape_config(args.shape), args.shape
    path = Path(args.store)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{args.store}: no config.json there, and not a shape name")
    return _shape_config(str(path)), str(path)


def _store_of(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The Store MODEL names (a folder with experts.json), or None (a shape or checkpoint)."""
    if args.shape is not None or not (Path(args.store) / "experts.json").is_file():
        return None
    if args.dense is not None or args.dense_override:
        raise ValueError(
            "--dense applies with --shape: a store's dense formats were chosen by "
            "`moetier convert --dense`"
        )
    from moetier.quant.store import Store

    return Store(args.store)


def _predict(args: argparse.Namespace) -> int:
    """--predict: measure the links, rank the candidates, print (or --json) the best, write
    it as a recipe (--write-recipe)."""
    import json
    import sys

    from moetier.cli import plan_links, recipes
    from moetier.residency import speed
    from moetier.residency.planner import parse_bytes

    hf_config, source = _model_config(args)
    context = args.max_context * args.batch
    links = plan_links.measure(args.disk)
    kinds = None if args.dense in (None, "auto") else (args.dense,)
    gpu, host = parse_bytes(args.gpu_memory), parse_bytes(args.host_memory)
    store = _store_of(args)
    if store is not None:  # its formats are fixed: only the embedding table's place varies
        options, refused = speed.store_candidates(store, gpu, host, context, links.speeds)
        args.experts = ",".join(sorted(store.formats))
    else:
        print(f"moetier plan: predicting {len(kinds or speed.AUTO_ORDER) * (2 if host else 1)} "
              "candidate configurations", file=sys.stderr, flush=True)  # fmt: skip
        options, refused = speed.candidates(
            hf_config, gpu, host, context, links.speeds, experts=args.experts,
            dense_kinds=kinds, overrides=args.dense_override,
        )  # fmt: skip
    chosen = speed.best(options) if options else None
    if args.write_recipe:
        if chosen is None:
            raise ValueError("no configuration fits these budgets: " + "; ".join(refused))
        target = _target(args, hf_config, source, context)
        data = recipes.from_option(target, chosen, args.gpu_memory, args.host_memory,
                                   _links_note(links))  # fmt: skip
        recipes.write(data, args.write_recipe)
        print(f"moetier plan: wrote {args.write_recipe}", file=sys.stderr)
    if args.json:
        print(json.dumps(_json(links, options, refused, chosen)))
        return 0 if chosen else 1
    print(links.describe())
    print(_table(options))
    for line in refused:
        print(f"refused: {line}")
    if chosen is None:
        print("no configuration fits these budgets")
        return 1
    print(f"best: {chosen.key} (the most precise within {speed.NEAR_BEST:.0%} of the fastest "
          "batch-1 decode)")  # fmt: skip
    print(chosen.plan.render())
    return 0


def _links_note(links) -> str:  # type: ignore[no-untyped-def]
    missing = links.not_measured()
    measured = ", ".join(f"{n} {getattr(links.speeds, n) / 1e9:.4g} GB/s" for n in links.measured)
    if not missing:
        return f"measured: {measured}"
    from moetier.residency.speed import DEFAULT_LINKS_SOURCE

    return (f"measured: {measured or 'none'}; defaults for {', '.join(missing)}: the "
            f"{DEFAULT_LINKS_SOURCE}")  # fmt: skip


def _target(args: argparse.Namespace, hf_config: dict, source: str, context: int):  # type: ignore[no-untyped-def, type-arg]
    """The recipes.Target a --write-recipe describes: its name from PATH, the model id and
    parser from --model-id / --parser, else the shipped recipe of the same shape, else the
    model type's parser."""
    from moetier.cli import recipes
    from moetier.residency.planner import parse_bytes
    from moetier.server.parsers.registry import MODEL_TYPES

    known = next((t for t in recipes.SHIPPED if t.shape == source), None)
    if Path(source).is_file():  # a config.json: absolute, so the recipe reads from anywhere
        source = str(Path(source).resolve())
    model = args.model_id or (known.model if known else _model_folder(args, source))
    parser = args.parser or (known.parser if known else None)
    parser = parser or MODEL_TYPES.get(str(hf_config.get("model_type")))
    if parser is None:
        raise ValueError(
            f"no parser known for model_type {hf_config.get('model_type')!r}: give --parser"
        )
    return recipes.Target(
        name=Path(args.write_recipe).stem,
        model=model,
        shape=source,
        gpu_gib=round(parse_bytes(args.gpu_memory) / 2**30, 2),
        host_gib=round(parse_bytes(args.host_memory) / 2**30, 2),
        nvme=args.disk is not None,
        context_length=context,
        parser=parser,
        experts=args.experts,
    )


def _model_folder(args: argparse.Namespace, config: str) -> str:
    """The recipe's model where no id is known: MODEL's folder (a store or a checkpoint), or
    the folder of the config.json given where it holds weights; absolute, so the recipe works
    from any directory. ValueError asking for --model-id where there is none."""
    folder = Path(args.store) if args.shape is None else Path(config).parent
    if not folder.is_dir():
        folder = folder.parent  # MODEL was a config.json
    weights = Path(config).is_file() and (
        (folder / "experts.json").is_file() or any(folder.glob("*.safetensors"))
    )
    if not weights:
        raise ValueError(
            f"--write-recipe: no Hugging Face id is known for {config} and no weights are "
            "beside it: give --model-id ORG/NAME (the model serve is to download), or plan a "
            "store or checkpoint folder"
        )
    return str(folder.resolve())


def _json(links, options, refused, chosen) -> dict:  # type: ignore[no-untyped-def, type-arg]
    from moetier.residency.cost import LinkSpeeds
    from moetier.residency.links import link_gbps

    def option(o) -> dict:  # type: ignore[no-untyped-def, type-arg]
        p, pred = o.plan, o.prediction
        return {
            "dense": o.dense,
            "embeddings": o.embeddings,
            "gpu_expert_slots": p.gpu_base_slots,
            "expert_blobs": p.base_blobs,
            "host_expert_blobs": p.host_blobs,
            "decode": pred.strategy,
            "decode_tok_s": {str(b): round(v, 2) for b, v in pred.decode_tok_s.items()},
            "decode_ms_per_step": {str(b): round(v, 4) for b, v in pred.decode_ms.items()},
            "prefill_tok_s": {str(b): round(v, 1) for b, v in pred.prefill_tok_s.items()},
        }

    speeds: LinkSpeeds = links.speeds
    return {
        "links": link_gbps(speeds),
        "measured": links.measured,
        "not_measured": links.not_measured(),
        "measure_s": round(links.seconds, 3),
        "candidates": [option(o) for o in options],
        "refused": refused,
        "best": option(chosen) if chosen else None,
    }


def _table(options) -> str:  # type: ignore[no-untyped-def]
    head = (
        f"{'dense':<6} {'embed':<5} {'GPU slots':>15} {'host blobs':>10} {'decode':<9} "
        f"{'dec b1':>9} {'dec b16':>9} {'pre b1':>9} {'pre b16':>9}  (tok/s, predicted)"
    )
    rows = [head]
    for o in options:
        p, pred = o.plan, o.prediction
        rows.append(
            f"{o.dense:<6} {o.embeddings:<5} {f'{p.gpu_base_slots}/{p.base_blobs}':>15} "
            f"{p.host_blobs:>10} {pred.strategy:<9} {pred.decode_tok_s[1]:>9.1f} "
            f"{pred.decode_tok_s[16]:>9.1f} {pred.prefill_tok_s[1]:>9.0f} "
            f"{pred.prefill_tok_s[16]:>9.0f}"
        )
    return "\n".join(rows)
