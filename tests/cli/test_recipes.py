"""Recipes (moetier/assets/recipes/*.yaml): each shipped one is what the planner gives for its
machine and fits it; loading refuses what is not a recipe; `serve --recipe` takes its settings
as defaults that flags override; `plan --write-recipe` writes one that `--recipe` reads."""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import tomllib
from pathlib import Path

import pytest
import yaml

from moetier.cli import hub, recipes, serve
from moetier.cli.main import main
from moetier.engine.engine import EngineLimits
from moetier.quant.dense_formats import DensePolicy
from moetier.quant.synthetic import shape
from moetier.residency import dense_choice
from moetier.residency.planner import parse_bytes, plan_shape

REPO = Path(__file__).resolve().parents[2]
ISSUE_MACHINES = {  # issue #48 item 2: model shape -> (GPU GB, RAM GB, NVMe)
    "glm-5": (96, 512, True),
    "deepseek-v4-flash": (32, 192, False),
    "qwen3-235b-a22b": (24, 128, False),
    "qwen3-30b-a3b": (12, 32, False),
    "gpt-oss-120b": (24, 64, False),
    "kimi-k2": (96, 768, True),
}


def serve_args(argv: list[str]) -> argparse.Namespace:
    """serve's arguments as `moetier serve ARGV` resolves them (cli/main.py), unstarted."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    hub.add_arguments(parser, "serve")
    parser.set_defaults(**serve.argument_defaults(argv))
    return parser.parse_args(argv)


def test_one_recipe_per_machine_of_the_issue():
    shipped = {recipes.load(n)["shape"]: recipes.load(n) for n in recipes.names()}
    assert set(shipped) == set(ISSUE_MACHINES)
    for name, (gpu, host, nvme) in ISSUE_MACHINES.items():
        hw = shipped[name]["hardware"]
        assert (hw["gpu"], hw["host"], hw["nvme"]) == (f"{gpu}GB", f"{host}GB", nvme)


@pytest.mark.parametrize("target", recipes.SHIPPED, ids=lambda t: t.name)
def test_shipped_recipe_is_the_planners_and_fits(target):
    on_disk = recipes.load(target.name)
    # what the planner gives now, written and read back, is the file (rebuild: python -m
    # moetier.cli.recipes --write)
    assert yaml.safe_load(recipes.render(recipes.build(target))) == on_disk.data
    data = on_disk.data
    budgets = data["budgets"]
    gpu, host = parse_bytes(budgets["gpu_memory"]), parse_bytes(budgets["host_memory"])
    # the budgets are within the machine's memory
    assert gpu <= target.gpu_gib * 2**30 and host <= target.host_gib * 2**30
    # the planner does not refuse it, and it keeps one token's experts in GPU slots
    p = plan_shape(
        shape(data["shape"]),
        gpu,
        host,
        experts=data["convert"]["experts"],
        dense=DensePolicy.parse(data["convert"]["dense"], data["convert"]["dense_overrides"]),
        max_context=data["context_length"],
        zero_copy_stage=3,
        embeddings_host=budgets["embeddings"] == "host",
    )
    assert dense_choice.useful(p)
    fixed = p.dense_bytes + p.kv_bytes + p.workspace_bytes
    assert fixed + p.gpu_base_slots * p.slot_bytes <= gpu
    assert p.host_blobs * p.slot_bytes + p.host_embedding_bytes <= max(host, 0)
    assert data["plan"]["gpu_expert_slots"] == p.gpu_base_slots
    assert data["plan"]["host_expert_blobs"] == p.host_blobs
    missing = p.base_blobs - p.gpu_base_slots - p.host_blobs
    # the experts the GPU and host RAM do not hold are read from disk: only with NVMe, direct
    assert missing == 0 or (target.nvme and budgets["expert_reads"] == "direct")
    assert data["gate"] == "off" and data["mtp"] == "off"


def test_recipes_are_package_data():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["moetier"]
    for path in recipes.RECIPE_DIR.glob("*.yaml"):
        rel = path.relative_to(recipes.RECIPE_DIR.parent.parent).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel


def _recipe() -> dict:
    return copy.deepcopy(recipes.load("qwen3-30b-a3b-12gb").data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(gpu_memory="8GiB"), "unknown key gpu_memory"),
        (lambda d: d["budgets"].update(gpu_memroy="8GiB"), "unknown key budgets.gpu_memroy"),
        (lambda d: d["budgets"].pop("gpu_memory"), "missing key budgets.gpu_memory"),
        (lambda d: d["budgets"].update(gpu_memory="lots"), "budgets.gpu_memory"),
        (lambda d: d["budgets"].update(embeddings="disk"), "budgets.embeddings"),
        (lambda d: d.update(context_length="4k"), "context_length must be a int"),
        (lambda d: d["parsers"].update(tool="qwen9"), "parsers.tool 'qwen9' is not a parser"),
        (lambda d: d["parsers"].update(reasoning="harmony"), "must agree"),
        (lambda d: d.update(gate="confidence"), "gate: off or a --delta rule"),
        (lambda d: d.update(mtp="on"), "mtp is 'on': off, or the drafts per step"),
        (lambda d: d.update(mtp=True), "mtp is 'on'"),  # YAML's reading of a bare on
        (lambda d: d.update(mtp=0), "mtp is 0"),
    ],
)
def test_what_is_not_a_recipe_is_refused_naming_the_key(tmp_path, change, message):
    data = _recipe()
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=message):
        recipes.load(path)


def test_bare_off_reads_as_off_and_aliases_are_parsers(tmp_path):
    text = recipes.render(_recipe()).replace("'off'", "off").replace("hermes", "qwen3")
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    assert yaml.safe_load(text)["gate"] is False  # YAML 1.1's reading of a bare off
    r = recipes.load(path)
    assert r["gate"] == "off" and r["parsers"]["tool"] == "qwen3"


def test_serve_recipe_gives_defaults_that_flags_override():
    data = recipes.load("gpt-oss-120b-24gb").data
    args = serve_args(["--recipe", "gpt-oss-120b-24gb"])
    assert args.store == data["model"] == "openai/gpt-oss-120b"
    assert args.gpu_memory == data["budgets"]["gpu_memory"]
    assert args.host_memory == data["budgets"]["host_memory"]
    assert args.embeddings == data["budgets"]["embeddings"]
    assert args.tool_parser == "harmony"
    assert (args.convert_experts, args.convert_dense) == ("q2s", data["convert"]["dense"])
    page = EngineLimits().page_size
    # the engine plans (num_pages + 1) pages: the recipe's context length exactly
    assert (args.num_pages + 1) * page == data["context_length"]
    given = serve_args(
        ["/some/store", "--recipe", "gpt-oss-120b-24gb", "--gpu-memory", "20GiB",
         "--tool-parser", "hermes", "--page-size", "32"]
    )  # fmt: skip
    assert given.store == "/some/store" and given.gpu_memory == "20GiB"
    assert given.tool_parser == "hermes" and given.host_memory == data["budgets"]["host_memory"]
    assert (given.num_pages + 1) * 32 == data["context_length"]
    # flags before --recipe win as well
    early = serve_args(["--gpu-memory", "18GiB", "--recipe", "gpt-oss-120b-24gb"])
    assert early.gpu_memory == "18GiB"
    plain = serve_args([])
    assert plain.gpu_memory == "" and plain.tool_parser == "" and plain.recipe is None


def test_a_gate_rule_becomes_serves_delta(tmp_path):
    data = _recipe()
    data["gate"] = "budget:0.25:weight"
    path = tmp_path / "gated.yaml"
    path.write_text(yaml.safe_dump(data))
    assert serve_args(["--recipe", str(path)]).delta == "budget:0.25:weight"
    assert serve_args(["--recipe", "qwen3-30b-a3b-12gb"]).delta == "all"  # off: the default


def test_mtp_drafts_become_serves_speculative_tokens(tmp_path):
    data = _recipe()
    data["mtp"] = 2
    path = tmp_path / "mtp.yaml"
    path.write_text(recipes.render(data))
    args = serve_args(["--recipe", str(path)])
    assert args.speculative_tokens == 2  # serve loads the MTP layer with it (cli/serve.py)
    assert serve_args(["--recipe", str(path), "--speculative-tokens", "1"]).speculative_tokens == 1
    assert serve_args(["--recipe", "qwen3-30b-a3b-12gb"]).speculative_tokens == 0  # off


def test_all_gpu_recipe_has_no_host_tier():
    data = recipes.load("qwen3-30b-a3b-12gb").data
    assert (
        data["plan"]["host_expert_blobs"] == 0 and parse_bytes(data["budgets"]["host_memory"]) == 0
    )
    assert serve_args(["--recipe", "qwen3-30b-a3b-12gb"]).host_memory == ""


def test_serve_recipe_list_and_unknown_names(capsys):
    assert main(["serve", "--recipe", "list"]) == 0
    out = capsys.readouterr().out
    for name in recipes.names():
        assert name in out
    assert main(["serve", "--recipe", "qwen3-31b"]) == 1
    err = capsys.readouterr().err
    assert "no recipe 'qwen3-31b'" in err and all(n in err for n in recipes.names())


def test_plan_writes_a_recipe_that_serve_reads_back(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    rc = main(["plan", "qwen3-30b-a3b", "--gpu-memory", "8GiB", "--host-memory", "24GiB",
               "--max-context", "8192", "--json", "--write-recipe", str(path)])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["not_measured"]) >= {"hbm", "h2d", "zero_copy"}  # no CUDA here
    r = recipes.load(path)
    best = result["best"]
    assert (
        r["convert"]["dense"] == best["dense"] and r["budgets"]["embeddings"] == best["embeddings"]
    )
    assert r["plan"]["gpu_expert_slots"] == best["gpu_expert_slots"]
    assert r["model"] == "Qwen/Qwen3-30B-A3B" and r["parsers"]["tool"] == "hermes"
    assert r["context_length"] == 8192 and r["name"] == "mine"
    args = serve_args(["--recipe", str(path)])
    assert (args.gpu_memory, args.host_memory) == ("8GiB", "24GiB")
    assert args.store == "Qwen/Qwen3-30B-A3B"
    # the best is a candidate, and the most precise within NEAR_BEST of the fastest
    fastest = max(c["decode_tok_s"]["1"] for c in result["candidates"])
    assert best in result["candidates"] and best["decode_tok_s"]["1"] >= 0.9 * fastest


def test_plan_of_a_store_keeps_its_formats(tmp_path, capsys):
    from moetier.config import DEFAULT_STORE
    from moetier.quant.store import Store
    from moetier.residency.planner import plan

    path = tmp_path / "demo.yaml"
    rc = main(["plan", str(DEFAULT_STORE), "--gpu-memory", "600MiB", "--host-memory", "1GiB",
               "--max-context", "512", "--json", "--write-recipe", str(path)])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    store = Store(DEFAULT_STORE)
    expected = plan(store, parse_bytes("600MiB"), parse_bytes("1GiB"), 512, zero_copy_stage=3)
    gpu_row = next(c for c in result["candidates"] if c["embeddings"] == "gpu")
    assert gpu_row["gpu_expert_slots"] == expected.gpu_base_slots
    assert {c["embeddings"] for c in result["candidates"]} == {"gpu", "host"}
    assert serve_args(["--recipe", str(path)]).store == str(DEFAULT_STORE)
    assert main(["plan", str(DEFAULT_STORE), "--gpu-memory", "1GiB", "--predict",
                 "--dense", "int4"]) == 1  # fmt: skip
    assert "--dense applies with --shape" in capsys.readouterr().err


def test_a_written_recipe_names_its_path_and_works_from_another_directory(
    tiny, tmp_path, monkeypatch, capsys
):
    import shutil

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(tiny.store("qwen3_moe"), work / "st" / "e")
    monkeypatch.chdir(work)
    # relative paths, as a user types them: the store folder, then its config.json
    for model in ("st/e", "st/e/config.json"):
        assert main(["plan", model, "--gpu-memory", "1GiB", "--predict",
                     "--write-recipe", "mine.yaml"]) == 0  # fmt: skip
        text = (work / "mine.yaml").read_text()
        assert f"`moetier serve --recipe {work / 'mine.yaml'}`" in text.splitlines()[0]
        monkeypatch.chdir(elsewhere)
        recipe = recipes.load(work / "mine.yaml")
        assert recipe["model"] == str(work / "st" / "e")
        assert recipe["shape"] == str(work / "st" / "e" / "config.json")
        assert serve_args(["--recipe", str(work / "mine.yaml")]).store == str(work / "st" / "e")
        monkeypatch.chdir(work)
    capsys.readouterr()
    # a file serve --recipe would take for a shipped recipe's name is refused
    assert main(["plan", "st/e", "--gpu-memory", "1GiB", "--write-recipe", "mine"]) == 1
    assert "name the file NAME.yaml" in capsys.readouterr().err
    # a shape with no known Hugging Face id and no weights: the recipe needs --model-id
    assert main(["plan", "deepseek-v3", "--gpu-memory", "80GiB", "--host-memory", "512GiB",
                 "--write-recipe", "ds.yaml"]) == 1  # fmt: skip
    assert "give --model-id ORG/NAME" in capsys.readouterr().err
    # the shipped recipes' headers name them
    shipped = (recipes.RECIPE_DIR / "qwen3-30b-a3b-12gb.yaml").read_text().splitlines()[0]
    assert "`moetier serve --recipe qwen3-30b-a3b-12gb`" in shipped
