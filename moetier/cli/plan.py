"""`moetier plan STORE --gpu-memory 24GiB [--host-memory 64GiB]`: what would go where; or
`moetier plan --shape NAME` for a model not converted, from its config.json alone."""

from __future__ import annotations

import argparse
from pathlib import Path

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
    parser.add_argument("--gpu-memory", required=True, help="GPU budget, e.g. 24GiB")
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
    from moetier.residency.planner import parse_bytes, plan, plan_shape

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
        result = plan_shape(hf_config, experts=args.experts, **budgets)
        print(f"{args.shape}: {_describe(hf_config, args.experts)}")
    else:
        from moetier.quant.store import Store

        result = plan(Store(args.store), **budgets)
    print(result.render())
    return 0


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
