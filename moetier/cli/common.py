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
