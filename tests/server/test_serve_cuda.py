"""`moetier serve` on CUDA as a user starts it (GPU): a real server process on loopback over a
synthetic q2s store of the Qwen3-30B-A3B shape (one layer), its default path (native, the decode
step compiled and graphed), the official `openai` client. It says when it is ready; a streamed
greedy completion's text equals the same request answered whole; four concurrent streams each
get every token they asked for; SIGTERM stops it. (The bench's 48-layer serve path failed on an
H100 at e60d607 while `moetier bench` and `moetier generate` on the same store ran: the
device's wheels lacked fastapi's dependencies.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from uvicorn_thread import free_port

pytestmark = pytest.mark.gpu

PROMPT = "The old lighthouse keeper climbed the stairs each evening and lit the lamp. " * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from moetier.config import DEFAULT_STORE
    from moetier.quant.synthetic import shape, write_synthetic_store

    store = write_synthetic_store(
        tmp_path_factory.mktemp("serve-cuda") / "store", shape("qwen3-30b-a3b", 1), "q2s",
        DEFAULT_STORE,
    )  # fmt: skip
    port = free_port()
    log = tmp_path_factory.mktemp("serve-cuda-log") / "server.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "moetier", "serve", str(store), "--device", "cuda",
             "--port", str(port)],
            stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            assert process.poll() is None, f"moetier serve exited:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, f"never ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield url, process, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(url: str, tokens: int) -> tuple[str, int]:
    text, usage = "", 0
    for chunk in _client(url).completions.create(
        model="store", prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return text, usage


def test_it_says_what_the_load_did(server):
    """The capture announced before it starts (a minute or more on a first start), then the
    ready line with its share."""
    url, process, log = server
    text = log.read_text()
    assert "moetier: compiling and capturing the decode step for 1 to " in text
    assert re.search(r"moetier serve: store ready in [\d.]+ s, of which [\d.]+ s compiling and "
                     r"capturing the decode steps", text), text[-3000:]  # fmt: skip


def test_a_stream_equals_the_whole_answer(server):
    url, process, log = server
    whole = _client(url).completions.create(
        model="store", prompt=PROMPT, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert whole.usage.completion_tokens == 24
    text, usage = _streamed(url, 24)
    assert usage == 24
    assert text == whole.choices[0].text, log.read_text()[-3000:]


def test_four_concurrent_streams_each_get_their_tokens(server):
    url, process, log = server
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: _streamed(url, 16 + 8 * n), range(4)))
    assert [usage for _, usage in results] == [16, 24, 32, 40], log.read_text()[-3000:]
    assert all(text for text, _ in results)
    assert "Traceback" not in log.read_text()


def test_sigterm_stops_it(server):
    url, process, log = server
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) in (0, -signal.SIGTERM), log.read_text()[-3000:]
