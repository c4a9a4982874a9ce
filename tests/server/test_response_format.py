"""`response_format` on /v1/chat/completions through the official `openai` client, on a real
uvicorn over a tiny random model: random weights are the hard case, the grammar alone must make
the answer valid JSON (against the schema, by `jsonschema`); a bad format or schema is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine
from moetier.loader.load import load_model
from moetier.server.app import create_app

MODEL = "tiny-qwen3"
USER = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def client(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))
    app = create_app(AsyncEngine(Engine(loaded)), MODEL)
    with serving(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 7)])
def test_json_schema(client, temperature, seed):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=200,
        temperature=temperature,
        seed=seed,
        response_format=JSON_SCHEMA,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=200,
        temperature=1.0,
        seed=3,
        stream=True,
        response_format=JSON_SCHEMA,
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


class Pet(BaseModel):
    kind: str = Field(max_length=5)
    legs: int = Field(ge=0, le=8)
    indoor: bool


def test_the_sdks_parse_with_a_pydantic_model(client):
    """The SDK turns a pydantic model into a strict json_schema and parses the answer back."""
    reply = client.chat.completions.parse(
        model=MODEL, messages=USER, max_tokens=200, temperature=0, response_format=Pet
    )
    pet = reply.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8 and len(pet.kind) <= 5


def test_json_object(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=200,
        temperature=1.0,
        seed=1,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_text_is_no_constraint(client):
    plain, text = (
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=12, temperature=0, **extra
        )
        .choices[0]
        .message.content
        for extra in ({}, {"response_format": {"type": "text"}})
    )
    assert plain == text


@pytest.mark.parametrize(
    "response_format, message",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
            "objectx",
        ),  # noqa: E501
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
            "nope",
        ),  # noqa: E501
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "json_schema"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
        ({"type": "xml"}, "type"),
        ({"type": "structural_tag", "structures": [], "triggers": ["<f"]}, "structures"),
    ],
)
def test_invalid_formats_are_400s(client, response_format, message):
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, response_format=response_format
        )
    assert info.value.status_code == 400
    assert info.value.response.json()["error"]["type"] == "invalid_request_error"


def test_completions_endpoint(client):
    """/v1/completions shares the sampling fields: response_format (vLLM takes it there too)."""
    reply = client.completions.create(
        model=MODEL,
        prompt="A person:",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": JSON_SCHEMA},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), PERSON)
