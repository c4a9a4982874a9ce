"""schemathesis against the server's own OpenAPI schema, on a real uvicorn over the tiny native
model: every operation gets valid requests (the schema's own examples) and invalid ones (wrong
types, missing fields, out-of-range values), over 1,000 in all. Whatever they send: no response
>= 500, every error body in its API's shape (docs/serving.md, "Errors") with a status and a
body the schema documents for its route, no stream that ends in an error event, and the engine
idle afterwards with every KV page free.

Output caps between 5 and 4,096 are cut to a few tokens so the run stays short; larger and
invalid ones are sent as generated (they must be 400s). A string `model` is the served name (an
unknown one is test_errors.py's)."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.core import NotSet
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.server.app import create_app
from moetier.server.errors import is_anthropic

MODEL = "tiny-qwen3"
EXAMPLES = {"POST": 90, "GET": 10, "HEAD": 10}  # per operation and generation mode
CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

pytestmark = pytest.mark.slow


def openai_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (
        set(body) == {"error"}
        and isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and isinstance(error["type"], str)
    )


def anthropic_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (
        body.get("type") == "error"
        and isinstance(error, dict)
        and set(error) == {"type", "message"}
        and isinstance(error["message"], str)
    )


def small_caps(body):
    """The body with output caps of 5..4096 cut to 1..4 (the tiny model on 2 cores), and a
    string `model` the served one (else nearly every request would stop at a 404)."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = MODEL
        for key in CAPS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 4 < value <= 4096:
                body[key] = value % 4 + 1
    return body


def check(case, response, path: str) -> None:
    status = response.status_code
    assert status < 500, f"{status} on {path}: {response.text[:500]}"
    if status >= 400:
        body = response.json()
        shaped = anthropic_error(body) if is_anthropic(path) else openai_error(body)
        assert shaped, f"{status} on {path} in the wrong shape: {body}"
        # and as the schema documents it: that status, that body
        case.validate_response(
            response, checks=[status_code_conformance, response_schema_conformance]
        )
        return
    content_type = (response.headers.get("content-type") or [""])[0]
    if content_type.startswith("text/event-stream"):
        for line in response.text.splitlines():
            assert line != "event: error", f"a stream on {path} ended in an error"
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                failed = event.get("error") or event.get("type") in ("error", "response.failed")
                assert not failed, f"a stream on {path} ended in an error: {line}"


def test_fuzz_the_openapi_schema(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=128)))
    app = create_app(engine, MODEL, SamplingParams(max_new_tokens=4))
    schema = schemathesis.openapi.from_dict(app.openapi())
    sent = 0
    statuses: dict[tuple[str, int], int] = {}

    def fuzz(operation, mode: GenerationMode, url: str) -> None:
        @settings(
            max_examples=EXAMPLES[operation.method.upper()],
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            nonlocal sent
            if not isinstance(case.body, NotSet):
                case.body = small_caps(case.body)
            response = case.call(base_url=url, timeout=60)
            sent += 1
            statuses[(operation.path, response.status_code)] = (
                statuses.get((operation.path, response.status_code), 0) + 1
            )
            check(case, response, operation.path)

        run()

    with serving(app) as url:
        for result in schema.get_all_operations():
            operation = result.ok()
            fuzz(operation, GenerationMode.POSITIVE, url)
            if operation.method.upper() == "POST":  # a GET without parameters has no invalid form
                fuzz(operation, GenerationMode.NEGATIVE, url)
        print(sorted(statuses.items()))
        assert sent >= 1000, sent
        # the valid requests went through: each generating route answered some with a 200
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/completions"):
            assert statuses.get((path, 200), 0) > 0, path
        assert engine.wait_idle(timeout=30)
        inner = engine.engine
        assert not inner.scheduler.running and not inner.scheduler.waiting
        assert inner.pool.used_pages == 0 and inner.streams == {}
