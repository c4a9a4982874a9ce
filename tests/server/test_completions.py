"""`/v1/completions` against the official `openai` client on a real uvicorn over a tiny model:
greedy answers equal the Generator's for the same prompt tokens, echo, several prompts and
token-id prompts, streaming equal to not, OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
import torch
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineLimits
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


def test_stop_strings_and_seeds(server, client):
    generator = server[1]
    prompt = "Once upon a time"
    want = greedy(generator, generator.prompt_ids(prompt), 12)
    stop = "ou"  # in the fixed tiny model's greedy answer, after its start
    assert 0 < want.text.find(stop)
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == want.text[: want.text.index(stop)]  # never emitted
    assert cut.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=seed
        )
        .choices[0]
        .text
        for seed in (11, 11, 12)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


def test_max_tokens_defaults_to_16_as_openai(server, client):
    generator = server[1]
    want = greedy(generator, generator.prompt_ids(PROMPTS[1]), 16)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0)
    assert resp.choices[0].text == want.text
    assert resp.usage.completion_tokens == generated(want)


def test_the_default_max_tokens_is_capped_by_the_context(server, client):
    """Left out, max_tokens is 16 capped by what the context leaves (as chat's default is): a
    prompt 6 tokens short of the context is answered with at most 6 tokens, not refused; an
    explicit max_tokens past the context stays a 400."""
    url, generator = server
    context = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    prompt = generator.prompt_ids(PROMPTS[0]) * context
    prompt = prompt[: context - 6]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.prompt_tokens == context - 6
    assert resp.usage.completion_tokens == 6 and resp.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    assert info.value.response.json()["error"]["code"] == "context_length_exceeded"


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


def test_n_sequences_of_several_prompts(server, client):
    generator = server[1]
    ids = [generator.prompt_ids(p) for p in PROMPTS]
    wants = [greedy(generator, i, 5) for i in ids]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]  # prompt i's are i*n .. i*n+n-1
    assert [c.text for c in resp.choices] == [w.text for w in wants for _ in range(2)]
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)  # each prompt counted once
    assert resp.usage.completion_tokens == 2 * sum(generated(w) for w in wants)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0, stream=True
    )
    texts = ["", "", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in resp.choices]


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
        if match == "context length":
            assert info.value.code == "context_length_exceeded"
    resp = httpx.post(server[0] + "/v1/completions", json={"model": MODEL})
    assert resp.status_code == 400
    assert "prompt" in resp.json()["error"]["message"]


# -- logprobs: against log_softmax of the HF transformers forward of the same checkpoint --------

TOKEN_PROMPTS = [[5, 17, 33, 2, 90, 41, 41, 8, 250, 12], [77, 3, 19, 19, 140, 6]]
ENDS = [141, 86, 79]  # the fixed tiny model's greedy next token here is the end of sequence


@pytest.fixture(scope="module", params=["transformers", "native"])
def fp32(tiny, request):
    """(base URL, tokenizer, the HF model): a float32 server (the transformers model class, or
    the native model over paged KV) beside the checkpoint's HF model."""
    from transformers import AutoModelForCausalLM

    config = EngineConfig(device="cpu", dtype="float32", native=request.param == "native")
    loaded = load_model(tiny.store("qwen3_moe"), config)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3_moe"), dtype=torch.float32, experts_implementation="eager"
    ).eval()
    with serving(create_app(AsyncEngine(Engine(loaded)), MODEL)) as url:
        yield url, loaded.tokenizer, hf


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is log_softmax of the logits after tokens[: p + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def top_texts(tokenizer, row: torch.Tensor, n: int) -> dict[str, float]:
    """The n most likely tokens of a logprob row: text -> logprob."""
    top = torch.topk(row, n)
    pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
    return {tokenizer.decode([t]): v for t, v in pairs}


def check_against(ref: torch.Tensor, tokenizer, ids: list[int], lp, first: int, n: int) -> None:
    """lp's entries first.. (token ids[first..]) equal ref's rows: the token's logprob, its N
    best alternatives (texts and values), texts and offsets."""
    for k in range(first, len(ids)):
        row = ref[k - 1]
        assert lp.tokens[k] == tokenizer.decode([ids[k]])
        assert lp.token_logprobs[k] == pytest.approx(float(row[ids[k]]), abs=1e-4)
        want = top_texts(tokenizer, row, n)
        got = lp.top_logprobs[k]
        assert set(got) == set(want) | {lp.tokens[k]}  # the chosen token is always listed
        for text, value in want.items():
            assert got[text] == pytest.approx(value, abs=1e-4)
    for k in range(1, len(ids)):
        assert lp.text_offset[k] - lp.text_offset[k - 1] == len(lp.tokens[k - 1])


def test_echo_logprobs_are_lm_evals_loglikelihood(fp32):
    url, tokenizer, hf = fp32
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    asked = [*TOKEN_PROMPTS, ENDS]
    resp = client.completions.create(
        model=MODEL, prompt=asked, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    eos = tokenizer.eos_token_id
    greedy = [int(hf_logprobs(hf, prompt)[-1].argmax()) for prompt in asked]
    assert greedy[-1] == eos and eos not in greedy[:-1]  # both cases, on the fixed tiny model
    for prompt, token, choice in zip(asked, greedy, resp.choices, strict=True):
        ids = [*prompt, token]  # the generated token is listed, an end of sequence too
        ref = hf_logprobs(hf, ids)
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids)
        assert (lp.token_logprobs[0], lp.top_logprobs[0], lp.text_offset[0]) == (None, None, 0)
        assert lp.tokens[0] == tokenizer.decode([prompt[0]])
        check_against(ref, tokenizer, ids, lp, 1, 2)
        completion = "" if token == eos else tokenizer.decode([token])
        assert choice.text == tokenizer.decode(prompt) + completion
        assert choice.finish_reason == ("stop" if token == eos else "length")
        assert lp.text_offset[len(prompt)] == len(tokenizer.decode(prompt))
        # lm-eval's parse_logprobs: the continuation is the prompt's tail, the last token generated
        ctxlen = 2
        tail = lp.token_logprobs[ctxlen:-1]
        want = sum(float(ref[k - 1, prompt[k]]) for k in range(ctxlen, len(prompt)))
        assert sum(tail) == pytest.approx(want, abs=1e-4)
        greedy_tail = all(
            t == max(top.values()) for t, top in zip(tail, lp.top_logprobs[ctxlen:-1], strict=True)
        )
        want_greedy = all(int(ref[k - 1].argmax()) == prompt[k] for k in range(ctxlen, len(prompt)))
        assert greedy_tail == want_greedy


def test_completion_logprobs_match_the_hf_forward(fp32):
    url, tokenizer, hf = fp32
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompt = TOKEN_PROMPTS[0]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, logprobs=3, max_tokens=6, temperature=0
    )
    [choice] = resp.choices
    lp = choice.logprobs
    # the tokens the server chose are the HF model's greedy ones: rebuild them step by step
    ids = list(prompt)
    for _ in range(len(lp.tokens)):
        ids.append(int(hf_logprobs(hf, ids)[-1].argmax()))
    generated = ids[len(prompt) :]
    assert len(generated) == resp.usage.completion_tokens == 6
    assert choice.text == tokenizer.decode(generated)
    ref = hf_logprobs(hf, ids)
    for k, token in enumerate(generated):
        row = ref[len(prompt) + k - 1]
        assert lp.tokens[k] == tokenizer.decode([token])
        assert lp.token_logprobs[k] == pytest.approx(float(row[token]), abs=1e-4)
        want = top_texts(tokenizer, row, 3)
        assert lp.top_logprobs[k] == pytest.approx(want, abs=1e-4)  # greedy: chosen is top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(generated))]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_equal_the_whole_answers(fp32, echo):
    client = openai.OpenAI(base_url=fp32[0] + "/v1", api_key="unused", max_retries=0)
    args = {"model": MODEL, "prompt": TOKEN_PROMPTS, "echo": echo, "logprobs": 2}
    whole = client.completions.create(**args, max_tokens=5, temperature=0)
    joined: list[dict] = [{}, {}]
    for chunk in client.completions.create(**args, max_tokens=5, temperature=0, stream=True):
        for choice in chunk.choices:
            for key, values in choice.logprobs.model_dump().items():
                joined[choice.index].setdefault(key, []).extend(values)
    assert joined == [c.logprobs.model_dump() for c in whole.choices]
    for got, prompt in zip(joined, TOKEN_PROMPTS, strict=True):
        assert len(got["tokens"]) == (len(prompt) if echo else 0) + 5


# -- clients that leave: every prompt's request aborted, the engine idle ----------------------


@pytest.fixture(scope="module")
def native(tiny):
    """The tiny native model over paged KV, prompts read 8 positions a step."""
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=256, max_num_batched_tokens=8)))
    with serving(create_app(engine, MODEL)) as url:
        yield url, engine


def long_body(stream: bool) -> dict:
    """Two prompts that would run to 200 tokens each (ignore_eos)."""
    return {
        "model": MODEL,
        "prompt": PROMPTS,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def assert_all_aborted_and_idle(engine: AsyncEngine, aborted: int) -> None:
    deadline = time.time() + 20
    while engine.stats.aborted < aborted + len(PROMPTS):  # a departure reaches it asynchronously
        assert time.time() < deadline, f"{engine.stats.aborted - aborted} aborted, not 2"
        time.sleep(0.01)
    assert engine.wait_idle(timeout=20), "the engine did not return to idle"
    time.sleep(0.05)  # the loop thread's stats of its last step
    inner = engine.engine
    assert not inner.scheduler.running and not inner.scheduler.waiting
    assert inner.pool.used_pages == 0 and inner.streams == {}


def test_a_client_gone_mid_stream_aborts_every_prompt(native):
    url, engine = native
    aborted = engine.stats.aborted
    with httpx.stream("POST", url + "/v1/completions", json=long_body(True), timeout=30) as resp:
        indexes: set[int] = set()
        for line in resp.iter_lines():  # until both prompts are under way
            if line.startswith("data: {"):
                indexes.update(c["index"] for c in json.loads(line[6:])["choices"])
            if indexes == {0, 1}:
                break
        assert indexes == {0, 1}
    assert_all_aborted_and_idle(engine, aborted)


def test_a_client_gone_before_the_whole_answers_aborts_every_prompt(native):
    url, engine = native
    aborted = engine.stats.aborted
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(long_body(False)).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    deadline = time.time() + 20
    while engine.stats.running < len(PROMPTS):
        assert time.time() < deadline
        time.sleep(0.005)
    sock.close()
    assert_all_aborted_and_idle(engine, aborted)
    after = httpx.post(url + "/v1/completions", json={**long_body(False), "max_tokens": 2})
    assert after.status_code == 200 and len(after.json()["choices"]) == 2


# -- several prompts' streams merged -------------------------------------------------------------


def test_merged_streams_keep_order_and_close_on_an_error():
    from moetier.server.completions import _merged

    closed: list[str] = []

    async def stream(name: str, items: list, error: Exception | None = None, end: bool = True):
        try:
            for item in items:
                await asyncio.sleep(0)
                yield item
            if error is not None:
                raise error
            if not end:
                await asyncio.sleep(60)  # a request that would go on
        finally:
            closed.append(name)

    async def run(streams):
        return [pair async for pair in _merged(streams)]

    got = asyncio.run(run([stream("a", [1, 2, 3]), stream("b", [4, 5])]))
    assert [o for i, o in got if i == 0] == [1, 2, 3] and [o for i, o in got if i == 1] == [4, 5]
    assert sorted(closed) == ["a", "b"]
    for error in (ValueError("refused"), RuntimeError("failed")):
        closed.clear()
        with pytest.raises(type(error), match=str(error)):
            asyncio.run(run([stream("a", [1], end=False), stream("b", [2], error)]))
        assert sorted(closed) == ["a", "b"]  # the other request is closed (aborted) too


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt_alone(fp32, stream):
    url, tokenizer, hf = fp32
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    args = {"model": MODEL, "prompt": TOKEN_PROMPTS, "echo": True, "logprobs": 2}
    resp = client.completions.create(**args, max_tokens=0)
    if stream:  # the streamed pieces joined must be the same answer
        chunks = list(client.completions.create(**args, max_tokens=0, stream=True))
        for choice in resp.choices:
            mine = [c for chunk in chunks for c in chunk.choices if c.index == choice.index]
            assert "".join(c.text for c in mine) == choice.text
            assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
            assert [t for c in mine for t in c.logprobs.tokens] == choice.logprobs.tokens
    for prompt, choice in zip(TOKEN_PROMPTS, resp.choices, strict=True):
        assert choice.text == tokenizer.decode(prompt)
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt)
        check_against(hf_logprobs(hf, prompt), tokenizer, prompt, lp, 1, 2)
    assert resp.usage.completion_tokens == 0
    assert resp.usage.prompt_tokens == sum(len(p) for p in TOKEN_PROMPTS)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=TOKEN_PROMPTS, max_tokens=0)
