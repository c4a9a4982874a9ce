"""Prompt renderers for model families that ship a Python encoder instead of a Jinja chat
template: `renderer_for(model_type, tokenizer)` gives the family's `render(messages, tools,
template_kwargs, continue_final) -> str` when the store has no chat template of its own (a
template in the store always wins), else None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moetier.server.renderers import deepseek_v4

Renderer = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any], bool], str]

RENDERERS: dict[str, Renderer] = {
    "deepseek_v4": deepseek_v4.render,  # encoding/encoding_dsv4.py
}


def renderer_for(model_type: str | None, tokenizer: Any) -> Renderer | None:
    """The family's renderer for a store of this model_type without a chat template."""
    if getattr(tokenizer, "chat_template", None):
        return None
    return RENDERERS.get(model_type or "")
