"""`/v1/completions` against the official `openai` client on a real uvicorn over a tiny model:
greedy answers equal the Generator's for the same prompt tokens, echo, several prompts and
token-id prompts, streaming equal to not, OpenAI-shaped errors."""

from __future__ import annotations

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

MODEL = "tiny-qwen3"
PROMPTS = ["Hello there", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))
    generator = Generator(loaded)
    app = create_app(AsyncEngine(Engine(loaded)), MODEL)
    with serving(app) as url:
        yield url, generator


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def greedy(generator: Generator, prompt_ids: list[int], max_tokens: int):
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    return generator.generate(prompt_ids, params)


def generated(expected) -> int:
    """Tokens generated: the text's, plus the end-of-sequence token it stopped on, if any."""
    return len(expected.token_ids) + (expected.finish_reason == "stop")


def test_greedy_completion_equals_the_generator(server, client):
    generator = server[1]
    ids = generator.prompt_ids(PROMPTS[0])
    want = greedy(generator, ids, 8)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    [choice] = resp.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, want.text, want.finish_reason)
    assert choice.logprobs is None
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == generated(want)
    assert resp.usage.total_tokens == len(ids) + generated(want)


def test_max_tokens_defaults_to_16_as_openai(server, client):
    generator = server[1]
    want = greedy(generator, generator.prompt_ids(PROMPTS[1]), 16)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0)
    assert resp.choices[0].text == want.text
    assert resp.usage.completion_tokens == generated(want)


def test_several_prompts_and_token_id_prompts(server, client):
    generator = server[1]
    ids = [generator.prompt_ids(p) for p in PROMPTS]
    wants = [greedy(generator, i, 6) for i in ids]
    for prompt in (PROMPTS, ids):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert [c.index for c in resp.choices] == [0, 1]
        assert [c.text for c in resp.choices] == [w.text for w in wants]
        assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
        assert resp.usage.completion_tokens == sum(generated(w) for w in wants)
    one = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=6, temperature=0)
    assert [c.text for c in one.choices] == [wants[1].text]


def test_echo_puts_the_prompt_first(server, client):
    generator = server[1]
    ids = generator.prompt_ids(PROMPTS[0])
    want = greedy(generator, ids, 5)
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True
    )
    assert resp.choices[0].text == PROMPTS[0] + want.text
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True
    )
    assert by_ids.choices[0].text == generator.tokenizer.decode(ids) + want.text


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_equals_the_whole_answer(client, echo):
    whole = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0, echo=echo
    )
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=10,
        temperature=0,
        echo=echo,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = ["", ""]
    finishes: list[list[str]] = [[], []]
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == [c.text for c in whole.choices]
    assert finishes == [[c.finish_reason] for c in whole.choices]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_usage_ends_with_done(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert '"usage"' not in "".join(lines)


def test_errors_are_openai_shaped_400s(server, client):
    vocab = len(server[1].tokenizer)
    cases = [
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": ""}, "empty"),
        ({"prompt": []}, "empty"),
        ({"prompt": [[1, 2], []]}, "empty"),
        ({"prompt": [1, vocab]}, f"token id {vocab}"),
        ({"prompt": [-1]}, "token id -1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**9}, "context length"),
    ]
    for extra, match in cases:
        with pytest.raises(openai.BadRequestError, match=match) as info:
            client.completions.create(model=MODEL, **extra)
        assert info.value.body["type"] == "invalid_request_error"
    resp = httpx.post(server[0] + "/v1/completions", json={"model": MODEL})
    assert resp.status_code == 400
    assert "prompt" in resp.json()["error"]["message"]
