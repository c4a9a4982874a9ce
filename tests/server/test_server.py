"""The HTTP server against the official `openai` client: a real uvicorn on loopback over the
serving engine (engine/async_engine.py), answers checked against the Generator alone."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.server.app import create_app


@pytest.fixture(scope="module")
def server(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))
    generator = Generator(loaded)
    app = create_app(AsyncEngine(Engine(loaded)), "tiny-qwen3")
    with serving(app) as url:
        yield url, generator


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def expected_greedy(generator, max_tokens: int) -> str:
    ids = generator.chat_prompt_ids(MESSAGES)
    return generator.generate(
        ids, SamplingParams(max_new_tokens=max_tokens, temperature=0), chat=True
    )


def generated(expected) -> int:
    """Tokens generated: the text's, plus an end-of-sequence token when it stopped on one (the
    engine counts every sampled token, as vLLM does; the Generator's token_ids leave it out)."""
    return len(expected.token_ids) + (expected.finish_reason == "stop")


def test_health_and_models(server, client):
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    head = httpx.head(server[0] + "/health")  # as load balancers and healthchecks ask
    assert head.status_code == 200 and head.content == b""
    assert [m.id for m in client.models.list().data] == ["tiny-qwen3"]


def test_chat_completion(server, client):
    expected = expected_greedy(server[1], 8)
    resp = client.chat.completions.create(
        model="tiny-qwen3", messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == expected.prompt_tokens
    assert resp.usage.completion_tokens == generated(expected)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # the transformers path


def test_chat_completion_streaming(server, client):
    expected = expected_greedy(server[1], 10)
    stream = client.chat.completions.create(
        model="tiny-qwen3",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == expected.text
    assert finishes == [expected.finish_reason]
    assert chunks[-1].usage.completion_tokens == generated(expected)


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny-qwen3", messages=[])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, n=1000)


def test_prompt_longer_than_the_context_is_a_400(server, client):
    limit = server[1].max_context
    long_text = "Hello there " * limit
    with pytest.raises(openai.BadRequestError, match=f"context length holds {limit} tokens"):
        client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": long_text}]
        )


def test_bad_sampling_and_template_input_is_a_400_not_a_failed_step(server, client):
    url, generator = server
    for extra in ({"seed": 2**64}, {"temperature": 1e-40}, {"max_tokens": 0}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="tiny-qwen3", messages=MESSAGES, **{"max_tokens": 4, **extra}
            )
    tokenizer = generator.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('no user message') }}"
    try:
        with pytest.raises(openai.BadRequestError, match="chat template refused"):
            client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=2)
    finally:
        tokenizer.chat_template = template
    assert client.chat.completions.create(
        model="tiny-qwen3", messages=MESSAGES, max_tokens=2
    ).choices


def test_logprob_bytes_of_a_token_inside_a_character_are_its_own(server, client):
    """A token that is one byte of a multi-byte character (logit_bias forces the first of 日's
    three bytes): its text is the replacement character, its `bytes` the byte itself (what a
    client rebuilds the character from), not the replacement character's UTF-8."""
    tokenizer = server[1].tokenizer
    first = tokenizer.encode("日", add_special_tokens=False)[0]
    assert tokenizer.decode([first]) == "\ufffd"  # the tiny vocabulary spells 日 byte by byte
    kwargs = dict(
        model="tiny-qwen3", messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True,
        logit_bias={str(first): 100},
    )  # fmt: skip
    (entry,) = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert entry.token == "\ufffd" and entry.bytes == list("日".encode()[:1])
    streamed = [
        e
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for e in choice.logprobs.content
    ]
    assert [e.bytes for e in streamed] == [entry.bytes]


@pytest.mark.parametrize(
    ("patched", "path", "body"),
    [
        (
            "moetier.server.anthropic.prepare_chat",
            "/v1/messages/count_tokens",
            {"model": "tiny-qwen3", "messages": MESSAGES[1:]},
        ),
        ("moetier.server.tokenize.tokenize", "/tokenize", {"prompt": "Hello there"}),
        (
            "moetier.server.completions.prompts",
            "/v1/completions",
            {"prompt": "Hi", "max_tokens": 1},
        ),
    ],
)
def test_tokenizing_a_long_prompt_does_not_stall_the_server(
    server, monkeypatch, patched, path, body
):
    """Counting and tokenizing prompts (Claude Code counts its whole conversation through
    /v1/messages/count_tokens) render and tokenize off the event loop, as the chat routes do: a
    conversation of hundreds of thousands of tokens takes seconds to tokenize, and on the loop
    it froze every other stream and /health for that long."""
    module, name = patched.rsplit(".", 1)
    real = getattr(__import__(module, fromlist=[name]), name)

    def slow(*args, **kwargs):
        time.sleep(1.5)  # a long conversation's tokenizing
        return real(*args, **kwargs)

    monkeypatch.setattr(patched, slow)
    answer = []
    slow_request = threading.Thread(
        target=lambda: answer.append(httpx.post(server[0] + path, json=body, timeout=30))
    )
    slow_request.start()
    time.sleep(0.3)  # the request is being tokenized
    began = time.perf_counter()
    assert httpx.get(server[0] + "/health", timeout=30).status_code == 200
    waited = time.perf_counter() - began
    slow_request.join()
    assert answer[0].status_code == 200
    assert waited < 0.5, f"/health waited {waited:.2f} s for another request's tokenizing"
