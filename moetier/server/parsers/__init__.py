"""Reasoning and tool calls out of raw model output, one streaming state machine per model
family (registry.py chooses it; base.py is what they share)."""

from moetier.server.parsers.base import Delta, Message, Parser, ToolCallDelta
from moetier.server.parsers.registry import (
    ALIASES,
    FAMILIES,
    choose_family,
    family_name,
    make_parser,
)

__all__ = [
    "ALIASES",
    "FAMILIES",
    "Delta",
    "Message",
    "Parser",
    "ToolCallDelta",
    "choose_family",
    "family_name",
    "make_parser",
]
