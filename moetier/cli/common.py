"""Flags and loading shared by the verbs that run a model."""

from __future__ import annotations

import argparse

from moetier.cli.flags import add_dataclass_arguments
from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.engine.sampler import SamplingParams


def add_model_arguments(parser: argparse.ArgumentParser, sampling: bool = True) -> None:
    """The STORE argument and the engine flags; with `sampling`, the sampling flags too."""
    parser.add_argument(
        "store",
        nargs="?",
        default=str(DEFAULT_STORE),
        help="a moetier store (output of `moetier convert`); default: the embedded demo model",
    )
    add_dataclass_arguments(parser, EngineConfig, "engine")
    if sampling:
        add_dataclass_arguments(parser, SamplingParams, "sampling")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams; ValueError for a --max-new-tokens below 1: the
    engine generates at least one token, so 0 would still print one (the server refuses
    max_tokens 0 likewise, but for a prompt echoed back)."""
    from moetier.cli.flags import dataclass_from_args

    if args.max_new_tokens < 1:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens}: give 1 or more (each run generates at "
            "least one token)"
        )
    return dataclass_from_args(SamplingParams, args)
