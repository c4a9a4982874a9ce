"""A bounded load test on a real uvicorn over the tiny native model: 64 concurrent streaming
clients (the official async `openai` client, every fourth one the `anthropic` client), 3
requests each, one request in ten leaving mid-stream. Every answer that runs to its end is the
Generator's greedy answer for its prompt, whole and in order, with its finish reason and usage;
every departed request is aborted; afterwards the engine is idle (nothing running or waiting,
every KV page free) and answers again."""

from __future__ import annotations

import asyncio
import threading
import time

import anthropic
import openai
import pytest
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.server.app import create_app

MODEL = "tiny-qwen3"
CLIENTS, REQUESTS = 64, 3
MAX_TOKENS = 12
PROMPTS = [
    "The sea was calm",
    "Tell me about the mountains and the rivers",
    "Hello there",
    "A short story about a fox, a crow and a piece of cheese",
    "Why is the sky blue?",
]


def leaves(client: int, request: int) -> bool:
    """Whether this request's client leaves mid-stream: one in ten."""
    return (client * REQUESTS + request) % 10 == 7


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))


def expected(loaded) -> dict[str, tuple[str, str, int]]:
    """(text, finish reason, tokens generated) of each prompt's greedy answer alone."""
    generator = Generator(loaded)
    out = {}
    for prompt in PROMPTS:
        ids = generator.chat_prompt_ids([{"role": "user", "content": prompt}])
        alone = generator.generate(
            ids, SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0), chat=True
        )
        generated = len(alone.token_ids) + (alone.finish_reason == "stop")
        out[prompt] = (alone.text, alone.finish_reason, generated)
    return out


async def openai_request(client, prompt: str, leave: bool) -> tuple[str, str | None, int | None]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, ids, pieces = "", None, None, set(), 0
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        pieces += bool(chunk.choices[0].delta.content)
        finish = chunk.choices[0].finish_reason or finish
        if leave and pieces == 2:
            await stream.close()
            return text, "left", None
    assert len(ids) == 1  # every chunk of one answer carries its id
    return text, finish, usage


async def anthropic_request(client, prompt: str, leave: bool) -> tuple[str, str | None, int | None]:
    text, pieces = "", 0
    async with client.messages.stream(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": prompt}],
        extra_body={"temperature": 0},
    ) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                text += event.delta.text
                pieces += 1
                if leave and pieces == 2:
                    return text, "left", None
        message = await stream.get_final_message()
    assert message.content[0].text == text
    finish = {"end_turn": "stop", "max_tokens": "length"}[message.stop_reason]
    return text, finish, message.usage.output_tokens


@pytest.mark.slow  # ~20 s on 2 cores, most of it loading and the answers alone
def test_64_streaming_clients_some_leaving(loaded):
    want = expected(loaded)
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=512, max_num_seqs=64)))
    app = create_app(engine, MODEL)
    with serving(app) as url:

        async def client(i: int) -> list:
            if i % 4 == 3:
                api = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
                call = anthropic_request
            else:
                api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                call = openai_request
            results = []
            async with api:
                for r in range(REQUESTS):
                    prompt = PROMPTS[(i + r) % len(PROMPTS)]
                    results.append((prompt, leaves(i, r), await call(api, prompt, leaves(i, r))))
            return results

        async def everyone() -> list:
            return await asyncio.gather(*(client(i) for i in range(CLIENTS)))

        aborted = engine.stats.aborted
        peak, done = [0], threading.Event()

        def watch() -> None:  # the most requests the engine held at once
            while not done.is_set():
                peak[0] = max(peak[0], engine.stats.running + engine.stats.waiting)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        began = time.monotonic()
        try:
            results = [result for batch in asyncio.run(everyone()) for result in batch]
        finally:
            done.set()
            watcher.join()
        elapsed = time.monotonic() - began
        assert peak[0] >= CLIENTS // 2, f"only {peak[0]} requests at once"

        assert len(results) == CLIENTS * REQUESTS  # none lost
        departed = 0
        for prompt, left, (text, finish, usage) in results:
            full, reason, generated = want[prompt]
            if left:
                departed += 1
                assert finish == "left" and full.startswith(text), (prompt, text)
                continue
            assert (text, finish, usage) == (full, reason, generated), prompt
        assert departed == sum(leaves(i, r) for i in range(CLIENTS) for r in range(REQUESTS))
        assert departed >= CLIENTS * REQUESTS // 10

        assert engine.wait_idle(timeout=30), "the engine did not return to idle"
        time.sleep(0.05)
        inner = engine.engine
        assert not inner.scheduler.running and not inner.scheduler.waiting
        assert inner.pool.used_pages == 0 and inner.streams == {}
        deadline = time.time() + 10
        while app.state.server.generating:  # the server's own count of requests in flight
            assert time.time() < deadline, app.state.server.generating
            time.sleep(0.01)
        # a departed request ends by abort unless its last tokens were already computed
        assert 0 < engine.stats.aborted - aborted <= departed
        again = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        reply = again.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=MAX_TOKENS, temperature=0,
        )  # fmt: skip
        assert reply.choices[0].message.content == want[PROMPTS[0]][0]
    print(f"{CLIENTS * REQUESTS} requests in {elapsed:.1f} s, {peak[0]} at once at most")
