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


def test_a_kv_cache_smaller_than_the_context_is_the_limit_reported(tiny):
    """A server whose KV pages hold fewer tokens than the model's context (serve --num-pages, a
    recipe's context_length) refuses longer requests at the pages' count: /v1/models and
    /tokenize report that, not the model's context (256)."""
    from moetier.engine.engine import EngineLimits

    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))
    limits = EngineLimits(num_pages=7, page_size=16)  # 112 tokens < 256
    assert int(loaded.model.config.max_position_embeddings) == 256
    with serving(create_app(AsyncEngine(Engine(loaded, limits)), MODEL)) as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 112
        assert httpx.post(url + "/tokenize", json={"prompt": "Hi"}).json()["max_model_len"] == 112
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ok = client.completions.create(model=MODEL, prompt=[5] * 111, max_tokens=1)
        assert ok.usage.prompt_tokens == 111
        with pytest.raises(openai.BadRequestError, match="KV cache holds 112 tokens"):
            client.completions.create(model=MODEL, prompt=[5] * 112, max_tokens=1)
