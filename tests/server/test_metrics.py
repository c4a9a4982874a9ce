"""`/metrics`: the residency telemetry in Prometheus text format, read back over HTTP."""

from __future__ import annotations

from fastapi.testclient import TestClient

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine
from moetier.loader.load import load_model
from moetier.residency.telemetry import ResidencyTelemetry
from moetier.server.app import create_app


def engine(tiny) -> AsyncEngine:
    return AsyncEngine(Engine(load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))))


def test_metrics_route(tiny):
    counters = ResidencyTelemetry()
    app = create_app(engine(tiny), "tiny-qwen3", telemetry=lambda: counters)
    with TestClient(app) as http:
        counters["gpu"].hits = 3
        response = http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert 'moetier_residency_hits_total{tier="gpu",model="tiny-qwen3"} 3\n' in response.text
        counters["gpu"].hits = 5  # read at each scrape, not once
        assert '{tier="gpu",model="tiny-qwen3"} 5\n' in http.get("/metrics").text
        text = http.get("/metrics").text
        assert 'moetier_engine_running_requests{model="tiny-qwen3"} 0\n' in text
        assert 'moetier_engine_kv_pages_free{model="tiny-qwen3"} 1024\n' in text


def test_serve_wires_the_slot_pool(tiny):
    """What `moetier serve` passes: the live counters of the model's slot pool."""
    served = engine(tiny)
    residency = served.engine.loaded.runtime.residency
    app = create_app(served, "tiny-qwen3")  # no telemetry given: the model's own slot pool
    with TestClient(app) as http:
        http.post(
            "/v1/chat/completions",
            json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2},
        )  # fmt: skip
        text = http.get("/metrics").text
    misses = residency.stats.misses
    assert misses > 0
    assert f'moetier_residency_misses_total{{tier="host",model="tiny-qwen3"}} {misses}\n' in text
