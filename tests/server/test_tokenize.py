"""`/tokenize`, `/detokenize` and `/v1/models` in vLLM's shapes on a real uvicorn over a tiny
model, checked against the model's own tokenizer and chat template."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine
from moetier.loader.load import load_model
from moetier.server.app import create_app

MODEL = "tiny-qwen3"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tiny):
    store = tiny.store("qwen3_moe")
    loaded = load_model(store, EngineConfig(device="cpu"))
    context = int(loaded.model.config.max_position_embeddings)
    with serving(create_app(AsyncEngine(Engine(loaded)), MODEL)) as url:
        yield url, AutoTokenizer.from_pretrained(store), context


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[0] + path, json=body)


def test_tokenize_a_prompt(server):
    url, tokenizer, context = server
    text = "Hello there, général Kenobi 🙂"
    resp = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert resp.status_code == 200
    body = resp.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == context
    assert body["token_strs"] is None
    strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


def test_tokenize_messages_through_the_chat_template(server):
    tokenizer = server[1]
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    body = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert body["count"] == len(body["tokens"])
    plain = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    no_gen = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert no_gen.json()["tokens"] == tokenizer.encode(plain, add_special_tokens=False)
    assert no_gen.json()["count"] < body["count"]


def test_detokenize_round_trip(server):
    tokenizer = server[1]
    text = "Round trip: ünïcödé, digits 12345 and 🙂."
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    resp = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert resp.status_code == 200
    assert resp.json() == {"prompt": tokenizer.decode(ids)}
    assert resp.json()["prompt"] == text


def test_tokenizer_errors_are_400s(server):
    vocab = len(server[1])
    cases = [
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"name": "f"}]}),  # chat's shape only
        ("/detokenize", {"tokens": [1, vocab]}),
        ("/detokenize", {"tokens": [-5]}),
        ("/detokenize", {"tokens": "abc"}),
    ]
    for path, body in cases:
        resp = post(server, path, body)
        assert resp.status_code == 400, (path, body, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_models_lists_the_context_length(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    assert model.id == MODEL
    assert model.max_model_len == server[2]  # type: ignore[attr-defined]


def test_tokenize_counts_what_chat_completions_reads(server):
    """Messages with tool history: /tokenize's count is the prompt /v1/chat/completions reads."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "developer", "content": "Answer now."},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    count = post(server, "/tokenize", {"messages": messages, "tools": tools}).json()["count"]
    chat = post(
        server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 1}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == count
