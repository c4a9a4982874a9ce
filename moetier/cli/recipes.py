"""Recipes: a model on a given machine, as YAML (moetier/assets/recipes/NAME.yaml, shipped in the
package): the model id, how to convert it, the tier budgets, gate, MTP, parser and context
length, with what the planner predicted. `moetier serve --recipe NAME|PATH` takes a recipe's
settings as defaults (flags given beside it win); `moetier serve --recipe list` lists them;
`moetier plan ... --write-recipe PATH` writes one.

Every shipped recipe is what `build` gives for its SHIPPED entry: the planner's best
configuration (residency/speed.py) for the card and RAM named there, at the cost model's
default link speeds; tests/cli/test_recipes.py rebuilds each and compares.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import moetier

RECIPE_DIR = Path(moetier.__file__).parent / "assets" / "recipes"
GIB = 2**30

# What a recipe may hold: key -> (type, required); nested mappings as dicts. Anything else is
# refused, naming the key (a misspelt budget must not be silently ignored).
SCHEMA: dict[str, Any] = {
    "name": (str, True),
    "description": (str, True),
    "model": (str, True),
    "shape": (str, False),
    "hardware": {"gpu": (str, True), "host": (str, True), "nvme": (bool, True)},
    "convert": {
        "experts": (str, True),
        "dense": (str, True),
        "dense_overrides": (list, False),
        "overrides": (list, False),
    },
    "budgets": {
        "gpu_memory": (str, True),
        "host_memory": (str, True),
        "disk": (str, False),
        "embeddings": (str, True),
        "expert_reads": (str, True),
    },
    "context_length": (int, True),
    "gate": (str, True),
    "mtp": (object, True),  # off, or drafts per step (validate)
    "parsers": {"tool": (str, True), "reasoning": (str, True)},
    "plan": (dict, False),  # what the planner predicted: informational, not applied
}

# gate: off, or a confidence-gate rule for the store's delta plane (serve --delta; docs/gate.md)
# mtp: off, or the drafts per step of speculative decoding with the model's MTP layer (serve
# --speculative-tokens, which loads the store's MTP layer: docs/serve.md)


@dataclass(frozen=True)
class Recipe:
    name: str
    data: dict[str, Any]
    path: Path | None = None

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def names() -> list[str]:
    """The shipped recipes' names, sorted."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def listing() -> str:
    """One line per shipped recipe: name and description."""
    rows = []
    for name in names():
        r = load(name)
        rows.append(f"{name:<28} {r['description']}")
    return "\n".join(rows)


def load(name_or_path: str | Path) -> Recipe:
    """A shipped recipe by name, or a recipe file by path; validated (`validate`)."""
    import yaml

    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        if str(name_or_path) not in names():
            raise ValueError(
                f"no recipe {str(name_or_path)!r}: give a recipe file's path or one of "
                f"{', '.join(names())} (`moetier serve --recipe list` describes them)"
            )
        path = RECIPE_DIR / f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path}: not valid YAML: {err}") from None
    validate(data, str(path))
    return Recipe(data["name"], data, path)


def validate(data: Any, source: str = "recipe") -> None:
    """ValueError naming the key where `data` is not a recipe: an unknown key, a missing one,
    a value of the wrong type, a budget that is not a size, an unknown parser, a gate that is
    not a --delta rule or an mtp that is neither off nor a count of drafts."""
    if isinstance(data, dict):
        for key in ("gate", "mtp"):  # YAML 1.1 reads a bare `off` as false
            if data.get(key) is False:
                data[key] = "off"
    _check_mapping(data, SCHEMA, source, "")
    from moetier.residency.planner import parse_bytes
    from moetier.server.parsers.registry import ALIASES, FAMILIES

    budgets = data["budgets"]
    for key in ("gpu_memory", "host_memory", "disk"):
        if key in budgets:
            try:
                parse_bytes(budgets[key])
            except ValueError as err:
                raise ValueError(f"{source}: budgets.{key}: {err}") from None
    for key, allowed in (("embeddings", ("gpu", "host")), ("expert_reads", ("mmap", "direct"))):
        if budgets[key] not in allowed:
            raise ValueError(f"{source}: budgets.{key} is {budgets[key]!r}: use {allowed}")
    families = []
    for key in ("tool", "reasoning"):
        value = data["parsers"][key]
        family = ALIASES.get(value, value)
        if family not in FAMILIES:
            raise ValueError(
                f"{source}: parsers.{key} {value!r} is not a parser: {', '.join(FAMILIES)}"
            )
        families.append(family)
    if families[0] != families[1]:
        raise ValueError(
            f"{source}: parsers.tool and parsers.reasoning name different parsers; one parser "
            "reads both, so they must agree"
        )
    mtp = data["mtp"]
    if mtp != "off" and (not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 1):
        shown = "on" if mtp is True else mtp  # YAML 1.1 reads a bare on as true
        raise ValueError(
            f"{source}: mtp is {shown!r}: off, or the drafts per step of speculative decoding "
            "with the model's MTP layer (serve --speculative-tokens), e.g. mtp: 2"
        )
    if data["gate"] != "off":
        from moetier.config import DeltaRule

        try:
            DeltaRule.parse(data["gate"])
        except ValueError as err:
            raise ValueError(f"{source}: gate: off or a --delta rule: {err}") from None
    if data["context_length"] < 16:
        raise ValueError(f"{source}: context_length must be at least one KV page (16)")


def _check_mapping(data: Any, schema: dict[str, Any], source: str, prefix: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: {prefix.rstrip('.') or 'the recipe'} must be a mapping")
    for key in data:
        if key not in schema:
            raise ValueError(f"{source}: unknown key {prefix}{key!s} (known: {', '.join(schema)})")
    for key, spec in schema.items():
        if isinstance(spec, dict):
            if key not in data:
                raise ValueError(f"{source}: missing key {prefix}{key}")
            _check_mapping(data[key], spec, source, f"{prefix}{key}.")
            continue
        kind, required = spec
        if key not in data:
            if required:
                raise ValueError(f"{source}: missing key {prefix}{key}")
            continue
        value = data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{source}: {prefix}{key} must be a {kind.__name__}, got {value!r}")


def serve_defaults(recipe: Recipe, page_size: int) -> dict[str, Any]:
    """`moetier serve`'s argument defaults from `recipe` (argparse dests): the model, budgets,
    KV pages for its context length, parser, the formats a Hub id is converted to, the gate
    rule and MTP drafts where it has them."""
    data = recipe.data
    budgets = data["budgets"]
    out: dict[str, Any] = {
        "store": data["model"],
        "gpu_memory": budgets["gpu_memory"],
        "embeddings": budgets["embeddings"],
        "expert_reads": budgets["expert_reads"],
        # the engine plans (num_pages + 1) pages of KV cache: the pool and a scratch page
        "num_pages": max(1, -(-data["context_length"] // page_size) - 1),
        "tool_parser": data["parsers"]["tool"],
        "convert_experts": data["convert"]["experts"],
        "convert_dense": data["convert"]["dense"],
    }
    from moetier.residency.planner import parse_bytes

    if data["gate"] != "off":
        out["delta"] = data["gate"]
    if data["mtp"] != "off":  # serve loads the store's MTP layer with --speculative-tokens
        out["speculative_tokens"] = data["mtp"]
    if parse_bytes(budgets["host_memory"]):
        out["host_memory"] = budgets["host_memory"]
    return out


def recipe_from_argv(argv: list[str]) -> str | None:
    """The --recipe value in a command line, if any (before the verb's own parsing)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--recipe")
    known, _ = parser.parse_known_args(argv)
    return known.recipe


# ---- building recipes from the planner ---------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A model on a machine: what a recipe is built for."""

    name: str
    model: str  # Hugging Face id
    shape: str  # quant/synthetic.SHAPES: the planner's config of the model
    gpu_gib: float  # the card
    host_gib: float  # the machine's RAM
    nvme: bool
    context_length: int
    parser: str
    experts: str = "q2s"

    def describe(self) -> str:
        nvme = " + NVMe" if self.nvme else ""
        return (
            f"{self.model} on one {self.gpu_gib:g} GB GPU + {self.host_gib:g} GB RAM{nvme}, "
            f"{self.context_length} tokens of KV cache"
        )


# The shipped recipes (issue #48 item 2). Context lengths: the KV cache all requests share.
SHIPPED = (
    Target("glm-5-96gb", "zai-org/GLM-5", "glm-5", 96, 512, True, 65536, "glm47"),
    Target(
        "deepseek-v4-flash-32gb",
        "deepseek-ai/DeepSeek-V4-Flash",
        "deepseek-v4-flash",
        32,
        192,
        False,
        32768,
        "deepseek_v4",
    ),  # fmt: skip
    Target(
        "qwen3-235b-a22b-24gb",
        "Qwen/Qwen3-235B-A22B",
        "qwen3-235b-a22b",
        24,
        128,
        False,
        16384,
        "hermes",
    ),  # fmt: skip
    Target(
        "qwen3-30b-a3b-12gb", "Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b", 12, 32, False, 16384, "hermes"
    ),  # fmt: skip
    Target(
        "gpt-oss-120b-24gb", "openai/gpt-oss-120b", "gpt-oss-120b", 24, 64, False, 32768, "harmony"
    ),  # fmt: skip
    Target(
        "kimi-k2-96gb", "moonshotai/Kimi-K2-Instruct", "kimi-k2", 96, 768, True, 65536, "kimi_k2"
    ),  # fmt: skip
)

# Budgets left to moetier of a card and a machine's RAM (a rule, not a measurement): the GPU
# keeps 6% for the CUDA context, the allocator's slack and other processes (the planner's
# 512 MiB workspace comes out of the rest); the host keeps an eighth, at least 8 GiB, for the
# OS, the page cache and the process itself.
GPU_SHARE = 0.94
HOST_KEEP = (1 / 8, 8)


def budgets_for(gpu_gib: float, host_gib: float) -> tuple[str, str]:
    """(--gpu-memory, --host-memory) for a card of `gpu_gib` and `host_gib` of RAM, to 0.5 GiB
    down."""
    gpu = math.floor(gpu_gib * GPU_SHARE * 2) / 2
    host = math.floor((host_gib - max(host_gib * HOST_KEEP[0], HOST_KEEP[1])) * 2) / 2
    return f"{gpu:g}GiB", f"{max(host, 0):g}GiB"


def build(
    target: Target,
    speeds: Any = None,
    links_note: str = "",
    gpu_memory: str | None = None,
    host_memory: str | None = None,
) -> dict[str, Any]:
    """The recipe of `target`: the planner's best option (residency/speed.py `best`) under its
    budgets (`budgets_for` its card and RAM unless given), predicted at `speeds` (default: the
    cost model's DEFAULT_LINKS)."""
    from moetier.residency import speed
    from moetier.residency.planner import parse_bytes

    speeds = speeds or speed.DEFAULT_LINKS
    gpu_default, host_default = budgets_for(target.gpu_gib, target.host_gib)
    gpu, host = gpu_memory or gpu_default, host_memory or host_default
    hf_config = _config(target.shape)
    options, refused = speed.candidates(
        hf_config, parse_bytes(gpu), parse_bytes(host), target.context_length, speeds,
        experts=target.experts,
    )  # fmt: skip
    if not options:
        raise ValueError(
            f"{target.name}: nothing fits --gpu-memory {gpu} --host-memory {host}: "
            + "; ".join(refused)
        )
    return from_option(target, speed.best(options), gpu, host, links_note or _default_note())


def from_option(
    target: Target, option: Any, gpu: str, host: str, links_note: str
) -> dict[str, Any]:
    """The recipe dict of `option` (a residency/speed.py Option) for `target`."""
    p = option.plan
    pred = option.prediction
    on_disk = p.base_blobs - p.gpu_base_slots - p.host_blobs > 0
    if p.host_blobs == 0 and option.embeddings == "gpu":
        host = "0"  # every expert on the GPU: no host tier to pin
    store_gb = (p.dense_bytes + p.base_blobs * p.slot_bytes) / 1e9
    return {
        "name": target.name,
        "description": target.describe(),
        "model": target.model,
        "shape": target.shape,
        "hardware": {
            "gpu": f"{target.gpu_gib:g}GB",
            "host": f"{target.host_gib:g}GB",
            "nvme": target.nvme,
        },
        "convert": {
            "experts": "source" if target.experts == "bfloat16" else target.experts,
            "dense": option.dense,
            "dense_overrides": [],
            "overrides": [],
        },
        "budgets": {
            "gpu_memory": gpu,
            "host_memory": host,
            "disk": f"{math.ceil(store_gb):d}GB",
            "embeddings": option.embeddings,
            "expert_reads": "direct" if on_disk else "mmap",
        },
        "context_length": target.context_length,
        "gate": "off",
        "mtp": "off",
        "parsers": {"tool": target.parser, "reasoning": target.parser},
        "plan": {
            "links": links_note,
            "gpu_expert_slots": p.gpu_base_slots,
            "expert_blobs": p.base_blobs,
            "host_expert_blobs": p.host_blobs,
            "decode": pred.strategy,
            "predicted_decode_tok_s": {b: _sig(v) for b, v in pred.decode_tok_s.items()},
            "predicted_prefill_tok_s": {b: _sig(v) for b, v in pred.prefill_tok_s.items()},
        },
    }


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def _default_note() -> str:
    from moetier.residency.speed import DEFAULT_LINKS_SOURCE

    return f"default link speeds (not measured): the {DEFAULT_LINKS_SOURCE}"


def _config(shape_or_path: str) -> dict[str, Any]:
    import json

    from moetier.quant.synthetic import SHAPES, shape

    if shape_or_path in SHAPES:
        return shape(shape_or_path)
    config: dict[str, Any] = json.loads(Path(shape_or_path).read_text())
    config.pop("quantization_config", None)
    return config


HEADER = """\
# moetier recipe (docs/recipes.md): `moetier serve --recipe {recipe}`.
# Written by the planner (`moetier plan`); flags given beside --recipe override its settings.
"""

COMMENTS = {
    "model": "Hugging Face id: serve downloads and converts it once (store cache)",
    "shape": "the planner's config of this model (moetier plan --shape)",
    "hardware": "the machine this recipe is for",
    "convert": "moetier convert --experts / --dense / --dense-override / --override",
    "budgets": "serve's --gpu-memory, --host-memory, --embeddings, --expert-reads; disk: the store",
    "context_length": "KV-cache positions all requests share (serve --num-pages)",
    "gate": "off, or a confidence-gate rule (serve --delta, docs/gate.md) for a delta plane",
    "mtp": "off, or drafts per step of MTP speculative decoding (serve --speculative-tokens)",
    "parsers": "serve --tool-parser (one parser reads reasoning and tool calls)",
    "plan": "the planner's prediction (not measured); informational",
}


def render(data: dict[str, Any], path: str | Path | None = None) -> str:
    """YAML text of a recipe dict, with a comment above each section; its header names the
    recipe as `--recipe` takes it: a shipped one by name, another by `path`, made absolute."""
    import shlex

    import yaml

    validate(data, data.get("name", "recipe"))
    recipe = data["name"]
    if path is not None and Path(path).resolve().parent != RECIPE_DIR.resolve():
        recipe = shlex.quote(str(Path(path).resolve()))
    out = [HEADER.format(recipe=recipe)]
    for key, value in data.items():
        if key in COMMENTS:
            out.append(f"# {COMMENTS[key]}\n")
        out.append(yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False))
    return "".join(out)


def write(data: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(data, path))
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m moetier.cli.recipes --write`: rebuild the shipped recipes from SHIPPED."""
    parser = argparse.ArgumentParser(prog="python -m moetier.cli.recipes")
    parser.add_argument("--write", action="store_true", help="rewrite moetier/assets/recipes/")
    args = parser.parse_args(argv)
    for target in SHIPPED:
        data = build(target)
        if args.write:
            print(write(data, RECIPE_DIR / f"{target.name}.yaml"))
        else:
            print(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
