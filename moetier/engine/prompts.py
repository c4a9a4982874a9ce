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
    continue_final: bool = False,
) -> list[int]:
    """The messages rendered by the tokenizer's chat template with the generation prompt, as
    token ids; `template_kwargs` reach the template as variables (`enable_thinking`, ...);
    `continue_final`: the last (assistant) message is left open for the model to continue, no
    generation prompt. ValueError if the model has no chat template or the template refuses
    them (its own raise_exception, or a render failure on what it was given)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use a plain prompt instead")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **(template_kwargs or {}),
        )
    except (TemplateError, TypeError, ValueError) as exc:
        # raise_exception, an undefined or unsafe access, `'…' + none`, or transformers' own
        # refusals (a final message the rendered text does not contain): the request's fault
        raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
    return tokenizer.encode(text, add_special_tokens=False)
