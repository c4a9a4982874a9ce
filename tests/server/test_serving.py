"""The server under concurrent and departing clients: a real uvicorn on loopback over the paged
serving engine (tiny native qwen3_moe), real clients (httpx, raw sockets, `moetier serve` in a
subprocess for SIGTERM). After every client that leaves, a new request is answered and the engine
returns to idle: nothing running or waiting, every KV page free."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from uvicorn_thread import free_port, serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.server.app import create_app

MODEL = "tiny-qwen3"  # a context of 256 positions


@pytest.fixture(scope="module")
def served(tiny):
    """A uvicorn thread serving the tiny native model; prompts are read 8 positions a step, so a
    long prompt's prefill spans many steps."""
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=256, max_num_batched_tokens=8)))
    with serving(create_app(engine, MODEL)) as url:
        yield url, engine, Generator(loaded)


def body(content: str, max_tokens: int, stream: bool, ignore_eos: bool = True) -> dict:
    """A greedy request; ignore_eos (vLLM's extension): it runs to max_tokens, so a client that
    leaves does so before it ends."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": ignore_eos,
    }


def wait_aborted(engine: AsyncEngine, count: int) -> None:
    """Until the engine has aborted `count` requests in all (a departed client's reaches it
    asynchronously)."""
    deadline = time.time() + 20
    while engine.stats.aborted < count:
        assert time.time() < deadline, f"{engine.stats.aborted} aborted, not {count}"
        time.sleep(0.01)


def assert_idle(engine: AsyncEngine) -> None:
    assert engine.wait_idle(timeout=20), "the engine did not return to idle"
    time.sleep(0.05)  # the loop thread's stats of its last step
    inner = engine.engine
    assert not inner.scheduler.running and not inner.scheduler.waiting
    assert inner.pool.used_pages == 0 and inner.streams == {} and inner.requests == {}
    runner = inner.runner  # no per-request state left behind (a server runs for weeks)
    assert not (runner.generators or runner.matchers or runner.prompt_masks or runner.keep_logits)
    assert engine.stats.running == 0 and engine.stats.pages_used == 0


def answered(url: str) -> str:
    reply = httpx.post(url + "/v1/chat/completions", json=body("Hello", 4, False), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def raw_request(url: str, payload: dict) -> socket.socket:
    """Send a POST on a raw socket and return it unread (the caller closes it)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(payload).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_client_gone_mid_stream(served):
    url, engine, _ = served
    aborted = engine.stats.aborted
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body("Tell me a story", 200, True), timeout=30
    ) as reply:
        lines = reply.iter_lines()
        seen = [next(lines) for _ in range(6)]  # the role chunk and a few tokens
        assert any('"content"' in line for line in seen)
    wait_aborted(engine, aborted + 1)  # ended early, not by running out of tokens
    assert_idle(engine)
    assert answered(url) is not None
    assert_idle(engine)


@pytest.mark.parametrize("prompt_words", [3, 50])  # before the first token; during prefill
def test_client_gone_before_its_first_token(served, prompt_words):
    url, engine, _ = served
    steps, aborted = engine.stats.steps, engine.stats.aborted
    sock = raw_request(url, body("word " * prompt_words, 60, True))
    if prompt_words > 3:  # a long prompt: leave while it is being read, 8 positions a step
        deadline = time.time() + 20
        while engine.stats.pages_used == 0:
            assert time.time() < deadline
            time.sleep(0.005)
        assert engine.stats.running == 1
    sock.close()
    wait_aborted(engine, aborted + 1)
    assert_idle(engine)
    assert engine.stats.steps > steps or prompt_words == 3
    assert answered(url) is not None
    assert_idle(engine)


def test_client_gone_before_a_whole_answer(served):
    url, engine, _ = served
    aborted = engine.stats.aborted
    sock = raw_request(url, body("Tell me a story", 200, False))
    deadline = time.time() + 20
    while engine.stats.running == 0:
        assert time.time() < deadline
        time.sleep(0.005)
    sock.close()
    wait_aborted(engine, aborted + 1)
    assert_idle(engine)
    assert answered(url) is not None


def test_eight_streams_all_start_before_any_finishes(served):
    url, engine, generator = served
    prompt = "The sea was calm"
    ids = generator.chat_prompt_ids([{"role": "user", "content": prompt}])
    alone = generator.generate(ids, SamplingParams(temperature=0, max_new_tokens=48), chat=True)
    tokens = len(alone.token_ids)
    assert tokens >= 12, "the fixed tiny model's answer is long enough to overlap streams"
    start, firsts, ends, texts = threading.Barrier(8), {}, {}, {}

    def client(i: int) -> None:
        start.wait()
        text = ""
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json=body(prompt, tokens, True, ignore_eos=False),
            timeout=60,
        ) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    firsts.setdefault(i, time.monotonic())
                    text += choices[0]["delta"]["content"]
        ends[i] = time.monotonic()
        texts[i] = text

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(firsts) == len(ends) == 8
    assert max(firsts.values()) < min(ends.values())
    assert set(texts.values()) == {alone.text}  # batched answers equal the answer alone
    assert_idle(engine)


def test_health_stays_fast_under_load(served):
    url, engine, _ = served
    aborted = engine.stats.aborted
    socks = [raw_request(url, body("word " * 20, 150, True)) for _ in range(20)]
    try:
        deadline = time.time() + 20
        while engine.stats.running + engine.stats.waiting < 20:  # all 20 taken in
            assert time.time() < deadline
            time.sleep(0.01)
        began = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        assert time.monotonic() - began < 2.0
        assert engine.stats.running + engine.stats.waiting > 0  # still busy
    finally:
        for sock in socks:
            sock.close()
    wait_aborted(engine, aborted + 19)  # at most one might have finished first
    assert_idle(engine)


def test_health_is_503_while_the_model_loads(tiny, capsys):
    release = threading.Event()
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))

    def factory() -> AsyncEngine:
        release.wait(timeout=30)
        return AsyncEngine(Engine(loaded))

    with TestClient(create_app(factory, MODEL)) as http:
        assert http.get("/health").status_code == 503
        assert http.get("/health").json() == {"status": "loading"}
        assert http.head("/health").status_code == 503
        reply = http.post("/v1/chat/completions", json=body("Hi", 2, False))
        assert reply.status_code == 503 and "loading" in reply.json()["error"]["message"]
        assert "ready" not in capsys.readouterr().out
        release.set()
        deadline = time.time() + 20
        while http.get("/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert http.post("/v1/chat/completions", json=body("Hi", 2, False)).status_code == 200
        assert http.head("/health").status_code == 200
    # the load said when it was done, and how long it took (the factory waited for `release`)
    assert re.search(rf"moetier serve: {MODEL} ready in \d+\.\d s\n", capsys.readouterr().out)


def test_sigterm_during_a_stream_exits_cleanly(tiny):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "moetier", "serve", str(tiny.store("qwen3_moe")), "--native",
         "--device", "cpu", "--port", str(port), "--model-name", MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server never became ready"
            time.sleep(0.2)
        whole: dict[str, httpx.Response] = {}  # a request answered whole, in flight too

        def ask_whole() -> None:
            chat = url + "/v1/chat/completions"
            whole["reply"] = httpx.post(chat, json=body("A tale", 220, False), timeout=30)

        waiting = threading.Thread(target=ask_whole)
        waiting.start()
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body("A story", 220, True), timeout=30
        ) as reply:
            lines = reply.iter_lines()
            while '"content": "' not in next(lines):  # until its first token: mid-answer
                pass
            server.send_signal(signal.SIGTERM)
            began = time.monotonic()
            # the engine stops first: the stream ends with the API's error event while its
            # connection is open (uvicorn's graceful window), not cut when the window closes
            events = [line for line in lines if line.startswith("data: ")]
        waiting.join(timeout=30)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit by SIGTERM)
        assert server.wait(timeout=15) in (0, -signal.SIGTERM)
        assert time.monotonic() - began < 15
        log = server.stdout.read()
        assert "Finished server process" in log
        assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log
        last = [json.loads(e[6:]) for e in events if e != "data: [DONE]"][-1]
        assert "shutting down" in last["error"]["message"], events[-3:]
        assert len(events) < 200  # it did not run to its end
        answer = whole["reply"]  # the whole answer's request: the API's 503, in its shape
        assert answer.status_code == 503, answer.text
        assert "shutting down" in answer.json()["error"]["message"]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_close_ends_open_requests_with_an_error(tiny):
    """Shutting the engine down mid-request: the request's iterator raises (a client sees an
    error, not a finished answer) and its pages are freed."""
    import asyncio

    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=64)))
    params = SamplingParams(temperature=0, max_new_tokens=200)

    async def consume() -> list:
        got = []
        with pytest.raises(RuntimeError, match="shutting down"):
            async for out in engine.generate([3, 4, 5], params, max_tokens=200, ignore_eos=True):
                got.append(out)
                if len(got) == 3:
                    threading.Thread(target=engine.close).start()
        return got

    got = asyncio.run(consume())
    assert 3 <= len(got) < 200 and all(out.finish_reason is None for out in got)
    assert engine.engine.pool.used_pages == 0 and engine.engine.streams == {}
    with pytest.raises(RuntimeError, match="shutting down"):
        asyncio.run(anext(engine.generate([3, 4], params)))


def _serve_exits(store, timeout: float = 60) -> subprocess.CompletedProcess:
    """`moetier serve STORE` in a process of its own, run to its exit (a hang fails the test)."""
    return subprocess.run(
        [sys.executable, "-m", "moetier", "serve", str(store), "--device", "cpu", "--port",
         str(free_port())],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_moetier_serve_refuses_a_path_that_is_not_a_store_before_it_listens(tmp_path):
    done = _serve_exits(tmp_path / "nothing")
    assert done.returncode != 0 and "(loading)" not in done.stdout  # it never started serving
    assert re.search(r"moetier serve: error: .*nothing is not a moetier store .*moetier convert",
                     done.stderr)  # fmt: skip


def test_moetier_serve_exits_1_when_the_model_fails_to_load(tiny, tmp_path):
    """A load that fails in the background (after the server started listening; here the dense
    weights' bytes are damaged, which their checksums find at load): the error on stderr, then
    the server stops and `moetier serve` exits with 1, instead of answering 503 for good. (A
    dense.safetensors that is gone, or whose header cannot be read, is refused before it
    listens.)"""
    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    with open(store / "dense.safetensors", "r+b") as f:
        f.seek(-300, os.SEEK_END)
        damaged = bytes(b ^ 0x5A for b in f.read(100))
        f.seek(-300, os.SEEK_END)
        f.write(damaged)
    done = _serve_exits(store)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "(loading)" in done.stdout and "ready" not in done.stdout
    assert "moetier serve: loading failed:" in done.stderr
    assert "corrupted dense.safetensors" in done.stderr
    (store / "dense.safetensors").unlink()
    done = _serve_exits(store)
    assert done.returncode == 1 and "(loading)" not in done.stdout
    assert "dense.safetensors is missing: run `moetier verify" in done.stderr


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_moetier_serve_refuses_a_port_that_cannot_be(port, capsys):
    from moetier.cli.main import main

    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error, before any load
        main(["serve", "--device", "cpu", "--port", port])
    assert exit_info.value.code == 2
    assert f"argument --port: '{port}': a port from 1 to 65535" in capsys.readouterr().err


def test_a_cpu_server_leaves_a_core_to_the_rest():
    """torch's threads when serving on the CPU: one fewer than its default (a core stays with
    the HTTP loop and the machine), at least one; OMP_NUM_THREADS given wins."""
    from moetier.cli.serve import serving_threads

    assert serving_threads({}, 2) == 1
    assert serving_threads({}, 16) == 15
    assert serving_threads({}, 1) == 1
    assert serving_threads({"OMP_NUM_THREADS": "2"}, 2) == 2
    assert serving_threads({"OMP_NUM_THREADS": " "}, 8) == 7
