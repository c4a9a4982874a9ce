"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages through the model's
chat template, into token ids with their count and the context length) and `POST /detokenize`
(token ids back into text)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel, Field, model_validator

from moetier.engine.async_engine import AsyncEngine
from moetier.server.errors import openai_error
from moetier.server.openai import ChatMessage, ChatTool
from moetier.server.parsers.serving import template_history
from moetier.server.state import ServerState, not_ready


class TokenizeRequest(BaseModel):
    """Either `prompt` (plain text) or `messages` (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None  # as /v1/chat/completions takes them
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.add_generation_prompt and self.continue_final_message and self.messages:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "set add_generation_prompt to false"
            )
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def max_model_len(engine: AsyncEngine) -> int:
    """The longest prompt plus completion the engine takes (vLLM's `max_model_len`): the
    model's context, or the KV cache's where it is smaller."""
    return int(engine.engine.scheduler.context_limit)


def check_ids(tokenizer: Any, ids: list[int], where: str) -> None:
    """ValueError if an id is not one of the tokenizer's."""
    vocab = len(tokenizer)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} is not in the vocabulary [0, {vocab})")


def tokenize(tokenizer: Any, req: TokenizeRequest, family: str | None = None) -> list[int]:
    """The request's token ids (messages as /v1/chat/completions renders them for the parser
    `family`); ValueError if the chat template refuses its messages."""
    if req.messages is None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        return list(tokenizer.encode(req.prompt or "", add_special_tokens=special))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: send a prompt instead of messages")
    messages = template_history([m.template_message() for m in req.messages], family)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=[t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None,
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
    except TemplateError as exc:
        raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
    return list(tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize", response_model=None)
    async def tokenize_route(req: TokenizeRequest) -> JSONResponse | dict[str, Any]:
        engine = state.engine
        if engine is None:
            return openai_error(*not_ready(state), "server_error")
        try:
            family = state.parser.family if state.parser else None
            # rendering and tokenizing a long prompt takes a while: off the event loop
            ids = await asyncio.to_thread(tokenize, engine.tokenizer, req, family)
        except ValueError as err:
            return openai_error(400, str(err))
        return {
            "count": len(ids),
            "max_model_len": max_model_len(engine),
            "tokens": ids,
            "token_strs": engine.tokenizer.convert_ids_to_tokens(ids)
            if req.return_token_strs
            else None,
        }

    @app.post("/detokenize", response_model=None)
    async def detokenize_route(req: DetokenizeRequest) -> JSONResponse | dict[str, Any]:
        engine = state.engine
        if engine is None:
            return openai_error(*not_ready(state), "server_error")
        try:
            check_ids(engine.tokenizer, req.tokens, "tokens")
        except ValueError as err:
            return openai_error(400, str(err))
        return {"prompt": engine.tokenizer.decode(req.tokens)}
