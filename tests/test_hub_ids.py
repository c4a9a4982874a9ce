"""Hugging Face Hub ids (issue #48): `moetier generate|convert ORG/NAME` resolve the id through
huggingface_hub, offline (HF_HUB_OFFLINE=1) from a Hub cache under HF_HOME laid out as
huggingface_hub lays it out (models--ORG--NAME/blobs, snapshots/COMMIT/ links, refs/main),
holding a tiny checkpoint. The store converted into the cache is byte for byte the one
`moetier convert` writes from the checkpoint folder; a second run converts nothing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetier.cli import hub

REPO = "tiny-org/tiny-qwen3-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(checkpoint: Path, hf_home: Path, extra: dict[str, bytes] | None = None) -> Path:
    """HF_HOME/hub holding `checkpoint` as REPO at COMMIT, as snapshot_download leaves it."""
    repo = hf_home / "hub" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    for name, data in {**files, **(extra or {})}.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def moetier(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moetier", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def offline(tiny, tmp_path_factory) -> tuple[dict[str, str], Path]:
    root = tmp_path_factory.mktemp("hub")
    hub_cache(tiny.checkpoint("qwen3_moe"), root / "hf")
    env = dict(os.environ, HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1")
    env["MOETIER_CACHE"] = str(root / "moetier")
    env.pop("HF_HUB_CACHE", None)
    return env, root


def test_hub_id_or_local_path():
    assert hub.is_hub_id("Qwen/Qwen3-30B-A3B")
    assert hub.is_hub_id("openai/gpt-oss-120b")
    assert not hub.is_hub_id("./qwen3-q2s")
    assert not hub.is_hub_id("/models/qwen3")
    assert not hub.is_hub_id("a/b/c")
    assert not hub.is_hub_id("tests")  # no ORG/


def test_download_is_limited_to_what_conversion_reads():
    from huggingface_hub.utils import filter_repo_objects

    # files of published MoE repositories (Qwen3-30B-A3B, gpt-oss-120b, DeepSeek-V3)
    repo = [
        ".gitattributes",
        "LICENSE",
        "README.md",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model-00001-of-00016.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "chat_template.jinja",
        "special_tokens_map.json",
        "original/model--00001-of-00007.safetensors",
        "original/config.json",
        "metal/model.bin",
        "pytorch_model-00001-of-00002.bin",
        "figures/benchmark.png",
        "inference/model.py",
    ]
    allow, ignore = hub.ALLOW_PATTERNS, hub.IGNORE_PATTERNS
    got = set(filter_repo_objects(repo, allow_patterns=allow, ignore_patterns=ignore))
    assert got == {
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model-00001-of-00016.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    }


@pytest.mark.slow
def test_generate_converts_a_hub_id_once_then_reuses_it(offline, tiny):
    env, root = offline
    args = ["generate", REPO, "--prompt", "Hello", "--max-new-tokens", "4", "--device", "cpu"]
    args += ["--temperature", "0"]
    first = moetier(args, env)
    assert first.returncode == 0, first.stderr
    store = root / "moetier" / "stores" / f"tiny-org--tiny-qwen3-moe--{COMMIT[:12]}--source"
    assert (store / "experts.json").is_file(), list((root / "moetier").rglob("*"))
    local = tiny.store("qwen3_moe")  # `moetier convert` of the checkpoint folder
    for name in ("experts.bin", "experts.json", "dense.safetensors", "config.json"):
        assert (store / name).read_bytes() == (local / name).read_bytes(), name
    stamp = (store / "experts.bin").stat().st_mtime_ns
    second = moetier(args, env)
    assert second.returncode == 0, second.stderr
    assert "using the converted store" in second.stderr and "converting" not in second.stderr
    assert (store / "experts.bin").stat().st_mtime_ns == stamp
    assert second.stdout == first.stdout  # greedy: the same store, the same text


def test_convert_takes_a_hub_id(offline, tiny, tmp_path):
    env, _ = offline
    out = tmp_path / "store"
    done = moetier(["convert", REPO, str(out)], env)
    assert done.returncode == 0, done.stderr
    local = tiny.store("qwen3_moe")
    assert (out / "experts.bin").read_bytes() == (local / "experts.bin").read_bytes()


def test_an_id_missing_offline_is_a_clear_error(offline):
    env, _ = offline
    done = moetier(["generate", "nobody/no-such-model", "--prompt", "x"], env)
    assert done.returncode == 1
    assert "nobody/no-such-model is not a local folder" in done.stderr
    assert "HF_HUB_OFFLINE" in done.stderr and "Traceback" not in done.stderr


def test_convert_checks_its_destination_before_downloading(offline, tmp_path):
    """An output folder convert must refuse is refused before the Hub is asked for anything:
    the id here is in no cache, so a download first would fail on that instead (on a real
    model, after hours of downloading)."""
    env, _ = offline
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine")
    done = moetier(["convert", "nobody/no-such-model", str(out)], env)
    assert done.returncode == 1
    assert str(out) in done.stderr and "--force replaces only a moetier store" in done.stderr
    assert "not a local folder" not in done.stderr and "Traceback" not in done.stderr
    assert (out / "todo.txt").read_text() == "mine"
    existing = tmp_path / "old-store"
    existing.mkdir()
    done = moetier(["convert", "nobody/no-such-model", str(existing)], env)
    assert done.returncode == 1 and "already exists" in done.stderr
