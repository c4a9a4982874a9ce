"""`moetier plan STORE --gpu-memory 24GiB [--host-memory 64GiB]`: what would go where; or
`moetier plan --shape NAME [--dense auto]` for a model not converted, from its config.json
alone; `moetier plan --dense-table`: docs/residency.md's table of `--dense auto` on the models
of issue #52."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetier.config import DEFAULT_STORE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moetier.quant.synthetic import SHAPES

    parser.add_argument("store", nargs="?", default=str(DEFAULT_STORE), help="a moetier store")
    parser.add_argument(
        "--shape",
        help=f"plan the whole model of this shape instead of a STORE ({', '.join(SHAPES)}), or "
        "of a config.json given by path: from the config alone, no weights",
    )
    parser.add_argument(
        "--experts",
        default="q2s",
        choices=("q2s", "bfloat16"),
        help="with --shape: the experts' stored format (default: q2s)",
    )
    parser.add_argument(
        "--dense",
        default="bf16",
        metavar="FORMAT",
        help="with --shape: the dense weights' format as `moetier convert --dense` writes it "
        "(bf16, fp8, int4, int4-gN, nvfp4), or auto: the largest precision (bf16 > fp8 > int4 > "
        "nvfp4) whose plan keeps at least one token's routed experts (MoE layers x top-k) in "
        "GPU slots besides staging (default: bf16)",
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


def run(args: argparse.Namespace) -> int:
    from moetier.residency.planner import parse_bytes, plan

    if args.dense_table:
        print(dense_table())
        return 0
    if args.gpu_memory is None:
        raise ValueError("--gpu-memory is required (e.g. --gpu-memory 24GiB)")
    budgets = dict(
        gpu_memory=parse_bytes(args.gpu_memory),
        host_memory=parse_bytes(args.host_memory),
        max_context=args.max_context,
        batch=args.batch,
        zero_copy_stage=args.zero_copy_stage,
        embeddings_host=args.embeddings == "host",
    )
    if args.shape is not None:
        if Path(args.store) != DEFAULT_STORE:
            raise ValueError("give a STORE or --shape, not both")
        hf_config = _shape_config(args.shape)
        print(f"{args.shape}: {_describe(hf_config, args.experts)}")
        result = _plan_dense(hf_config, args, budgets)
    else:
        if args.dense != "bf16" or args.dense_override:
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
    policy = DensePolicy.parse(args.dense, args.dense_override)
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
