"""API keys and CORS on a real uvicorn server, with the official `openai` and `anthropic`
clients: a wrong or missing key is a 401 in each API's shape and generates nothing (no engine
step, no prompt looked up); either header carries a right key; `/health` stays open; CORS
preflights are answered only for the allowed origins. Also where the keys come from, and the
warning `moetier serve` prints when it listens beyond loopback without one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from uvicorn_thread import free_port, serving

from moetier.cli.serve import _loopback
from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineLimits
from moetier.loader.load import load_model
from moetier.server.app import create_app
from moetier.server.auth import keys_from
from moetier.server.options import ServerOptions

MODEL = "tiny-qwen3"
USER = [{"role": "user", "content": "Hello there"}]
KEYS = ("key-one", "key-two")
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=64)))
    options = ServerOptions(api_key=KEYS, allowed_origins=(ORIGIN,))
    with serving(create_app(engine, MODEL, options=options)) as url:
        yield url, engine


def untouched(engine: AsyncEngine) -> tuple[int, int, int]:
    """What any generation would change: steps, prompt tokens looked up, requests aborted."""
    stats = engine.engine
    return engine.stats.steps, stats.pool.stats.queried_tokens, stats.aborted


def test_wrong_or_missing_key_is_401_and_generates_nothing(server):
    url, engine = server
    before = untouched(engine)
    for key in ("wrong", "key-one-and-more", "KEY-ONE"):
        oai = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
        error = info.value.response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, stream=True)
        with pytest.raises(openai.AuthenticationError):
            oai.models.list()
        claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            claude.messages.create(model=MODEL, max_tokens=4, messages=USER)
        body = info.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            claude.messages.count_tokens(model=MODEL, messages=USER)
        for listing, args in ((claude.models.list, ()), (claude.models.retrieve, (MODEL,))):
            with pytest.raises(anthropic.AuthenticationError) as info:
                listing(*args)  # /v1/models in Anthropic's shape, its error too
            body = info.value.response.json()
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    # no key at all
    body = {"model": MODEL, "messages": USER, "max_tokens": 4}
    for path in ("/v1/chat/completions", "/v1/messages"):
        reply = httpx.post(url + path, json=body)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/openapi.json").status_code == 401
    time.sleep(0.2)  # anything that reached the engine would have stepped by now
    assert untouched(engine) == before
    assert engine.engine.streams == {}


def test_right_key_in_either_header(server):
    url, engine = server
    for key in KEYS:
        oai = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)  # Bearer
        assert oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices
        claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)  # x-api-key
        assert claude.messages.create(model=MODEL, max_tokens=2, messages=USER).content
        # Claude Code's ANTHROPIC_AUTH_TOKEN: a Bearer header
        claude = anthropic.Anthropic(base_url=url, auth_token=key, max_retries=0)
        assert claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
    metrics = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEYS[0]}"})
    assert metrics.status_code == 200 and "moetier_engine_steps_total" in metrics.text


def test_health_is_open(server):
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


def test_cors_preflight_for_allowed_origins_only(server):
    url, _ = server
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    reply = httpx.options(url + "/v1/chat/completions", headers={"origin": ORIGIN, **preflight})
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in reply.headers["access-control-allow-methods"]
    other = httpx.options(
        url + "/v1/chat/completions", headers={"origin": "http://evil.example", **preflight}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # a real request from the allowed origin carries the header
    reply = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 2},
        headers={"origin": ORIGIN, "authorization": f"Bearer {KEYS[1]}"},
    )
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_without_allowed_origins(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=64)))
    with serving(create_app(engine, MODEL)) as url:
        reply = httpx.options(
            url + "/v1/chat/completions",
            headers={"origin": ORIGIN, "access-control-request-method": "POST"},
        )
        assert reply.status_code == 405 and "access-control-allow-origin" not in reply.headers
        reply = httpx.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": USER, "max_tokens": 2},
            headers={"origin": ORIGIN},
        )
        assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
    engine.close()


def test_keys_from_flags_or_the_environment():
    assert keys_from(["a", "b"], {"MOETIER_API_KEY": "c"}) == ("a", "b")
    assert keys_from(None, {"MOETIER_API_KEY": " c , d ,"}) == ("c", "d")
    assert keys_from([], {}) == ()
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("192.168.1.5") and not _loopback("myhost")


def test_serve_warns_beyond_loopback_without_a_key(tiny):
    port = free_port()
    args = [sys.executable, "-m", "moetier", "serve", str(tiny.store("qwen3_moe")), "--device",
            "cpu", "--port", str(port)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MOETIER_API_KEY"}
    cases = ((["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key", "k"], False))
    for extra, warned in cases:
        server = subprocess.Popen(
            args + extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        try:
            deadline = time.time() + 60
            while True:  # up once /health answers (the warning is printed before)
                assert server.poll() is None
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code:
                        break
                except httpx.TransportError:
                    pass
                assert time.time() < deadline
                time.sleep(0.2)
        finally:
            server.terminate()
            output = server.communicate(timeout=20)[0]
        assert ("without an API key" in output) == warned, output
