"""The sampling fields the OpenAI surfaces share (`/v1/chat/completions`, `/v1/completions`,
`/v1/responses` maps its own names onto them): one pydantic base, and its mapping onto the
engine's SamplingParams under the server's defaults."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moetier.engine.grammar import check_grammar
from moetier.engine.sampler import SamplingParams

MAX_N = 128  # sequences a request may ask for (the n x max_tokens cap applies too)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's name, description, schema and strict (the schema
    is always enforced; without one, any JSON value)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(default="response", max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, json_object, json_schema; and vLLM's structural_tag
    (`structures` [{begin, schema, end}] and `triggers`). Enforced by a grammar
    (engine/grammar.py)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _needs_its_fields(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format type "json_schema" needs a "json_schema" object')
        if self.type == "structural_tag" and (self.structures is None or self.triggers is None):
            raise ValueError('response_format type "structural_tag" needs structures and triggers')
        return self

    def grammar(self) -> tuple[str, str] | None:
        """SamplingParams.grammar for this format (None: plain text)."""
        if self.type == "json_object":
            return ("json_object", "")
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.json_schema
            return ("json_schema", json.dumps({} if schema is None else schema))
        if self.type == "structural_tag":
            spec = {"structures": self.structures, "triggers": self.triggers}
            return ("structural_tag", json.dumps(spec))
        return None


class SamplingFields(BaseModel):
    # NaN and infinities (JSON's NaN, Infinity) are refused as such: "should be a finite
    # number", not a range's bound that NaN fails ("should be less than or equal to 2")
    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)  # vLLM's extension
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens through end tokens
    response_format: ResponseFormat | None = None

    def asked_max_tokens(self) -> int | None:
        """The output cap the client asked for (None: the server's default)."""
        return self.max_tokens

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """The engine's SamplingParams: the request's fields over the server's defaults;
        ValueError if the engine cannot take them."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        grammar = self.response_format.grammar() if self.response_format else None
        if grammar is not None:
            try:
                check_grammar(*grammar)
            except ValueError as err:
                raise ValueError(f"response_format: {err}") from err
        bias = []
        for key, value in (self.logit_bias or {}).items():
            try:
                bias.append((int(key), float(value)))
            except ValueError:
                raise ValueError(f'logit_bias key {key!r}: use a token id, e.g. "1234"') from None
        return SamplingParams(
            max_new_tokens=defaults.max_new_tokens,
            temperature=self.temperature if self.temperature is not None else defaults.temperature,
            top_p=self.top_p if self.top_p is not None else defaults.top_p,
            top_k=self.top_k if self.top_k is not None else defaults.top_k,
            seed=self.seed,
            stop=stop,
            grammar=grammar,
            min_p=self.min_p if self.min_p is not None else defaults.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=tuple(bias),
        )
