"""CLI flags derived from config dataclasses, so each setting is defined once."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One `--field-name` flag per dataclass field, typed and defaulted from the field (fields
    whose metadata says `"flag": False` have none)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("flag", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        help_text = f.metadata.get("help", "")
        default = f.default
        if typing.get_origin(hint) is tuple:  # repeatable flag
            group.add_argument(
                flag,
                action="append",
                default=None,
                dest=f.name,
                help=f"{help_text} (default: none)",
            )
            continue
        if hint is bool:  # an on/off switch: `--native` / `--no-native`, not `--native True`
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                dest=f.name,
                help=help_text,
            )
            continue
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kind = args[0] if args else hint
        group.add_argument(
            flag, type=kind, default=default, dest=f.name, help=f"{help_text} (default: {default})"
        )


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.metadata.get("flag", True):
            continue  # no flag: the field's default
        value = getattr(args, f.name)
        if isinstance(value, list):
            value = tuple(value)
        if value is None and f.default is not None and f.default is not dataclasses.MISSING:
            value = f.default
        values[f.name] = value
    return cls(**values)
