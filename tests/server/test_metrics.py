"""`/metrics`: the engine's stats and the residency telemetry in Prometheus text format, read
back over HTTP with prometheus_client's own parser (the names and labels scrapers see)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine
from moetier.loader.load import load_model
from moetier.residency.telemetry import METRICS, ResidencyTelemetry
from moetier.server.app import create_app
from moetier.server.metrics import ENGINE_METRICS


def engine(tiny) -> AsyncEngine:
    return AsyncEngine(Engine(load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))))


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a scrape, parsed by prometheus_client."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_route(tiny):
    counters = ResidencyTelemetry()
    app = create_app(engine(tiny), "tiny-qwen3", telemetry=lambda: counters)
    with TestClient(app) as http:
        counters["gpu"].hits = 3
        response = http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        gpu = (("model", "tiny-qwen3"), ("tier", "gpu"))
        model = (("model", "tiny-qwen3"),)
        assert samples(response.text)[("moetier_residency_hits_total", gpu)] == 3
        counters["gpu"].hits = 5  # read at each scrape, not once
        scraped = samples(http.get("/metrics").text)
        assert scraped[("moetier_residency_hits_total", gpu)] == 5
        assert scraped[("moetier_engine_running_requests", model)] == 0
        assert scraped[("moetier_engine_kv_pages_free", model)] == 1024
        # today's names, every one of them
        names = {name for name, _ in scraped}
        assert {f"moetier_engine_{name}" for name, *_ in ENGINE_METRICS} <= names
        assert {f"moetier_residency_{name}" for name, *_ in METRICS} <= names
        assert "moetier_engine_aborted_total" in names
        # an OpenMetrics scraper gets OpenMetrics
        om = http.get("/metrics", headers={"accept": "application/openmetrics-text"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")


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
    host = ("moetier_residency_misses_total", (("model", "tiny-qwen3"), ("tier", "host")))
    assert samples(text)[host] == misses


def test_http_answers_counted_by_route_and_status(tiny):
    app = create_app(engine(tiny), "tiny-qwen3")
    chat = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(app) as http:
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.post("/v1/chat/completions", json={**chat, "top_p": 5}).status_code == 400
        assert http.post("/v1/chat/completions", json={**chat, "model": "x"}).status_code == 404
        assert http.get("/v1/nowhere/at/all").status_code == 404
        assert http.get("/v1/chat/completions").status_code == 405
        assert http.get("/v1/models/tiny-qwen3").status_code == 200
        assert http.get("/v1/models/org/other-model").status_code == 404
        scraped = samples(http.get("/metrics").text)
    model = ("model", "tiny-qwen3")

    def answered(route: str, status: int) -> float:
        key = (model, ("route", route), ("status", str(status)))
        return scraped[("moetier_http_responses_total", key)]

    assert answered("/v1/chat/completions", 200) == 1
    assert answered("/v1/chat/completions", 400) == 1
    assert answered("/v1/chat/completions", 404) == 1
    assert answered("/v1/chat/completions", 405) == 1
    assert answered("other", 404) == 1  # an unknown path is not a label of its own
    # a templated route is one label, whatever the id asked for
    assert answered("/v1/models/{model_id:path}", 200) == 1
    assert answered("/v1/models/{model_id:path}", 404) == 1
