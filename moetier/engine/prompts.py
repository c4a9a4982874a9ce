"""Prompt token ids: chat messages through the model's own chat template (transformers'
rendering), or plain text."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The messages rendered by the tokenizer's chat template with the generation prompt, as
    token ids; `template_kwargs` reach the template as variables (`enable_thinking`, ...);
    ValueError if the model has no chat template or the template refuses them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use a plain prompt instead")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
            **(template_kwargs or {}),
        )
    except TemplateError as exc:  # the template's own raise_exception, or a render failure
        raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
    return tokenizer.encode(text, add_special_tokens=False)
