"""Which parser a model gets: by a fingerprint of its chat template (the markers its tool calls
render with), else by its config's model_type; names and aliases for `--tool-parser`,
`--reasoning-parser` and `moetier parse --family`."""

from __future__ import annotations

import re

from moetier.server.parsers.base import Parser
from moetier.server.parsers.deepseek_v3 import DeepSeekV3Parser
from moetier.server.parsers.deepseek_v4 import DeepSeekV4Parser
from moetier.server.parsers.deepseek_v31 import DeepSeekV31Parser
from moetier.server.parsers.deepseek_v32 import DeepSeekV32Parser
from moetier.server.parsers.glm45 import Glm45Parser, Glm47Parser
from moetier.server.parsers.harmony import HarmonyParser
from moetier.server.parsers.hermes import HermesParser
from moetier.server.parsers.kimi_k2 import KimiK2Parser
from moetier.server.parsers.minimax_m2 import MiniMaxM2Parser
from moetier.server.parsers.mistral import MistralParser
from moetier.server.parsers.qwen3_coder import Qwen3CoderParser

FAMILIES: dict[str, type[Parser]] = {
    cls.family: cls
    for cls in (
        HermesParser,
        Qwen3CoderParser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        DeepSeekV32Parser,
        DeepSeekV4Parser,
        Glm45Parser,
        Glm47Parser,
        KimiK2Parser,
        HarmonyParser,
        MiniMaxM2Parser,
        MistralParser,
    )
}

# Other servers' names for the same parsers (vLLM, SGLang, llama.cpp, Ollama).
ALIASES = {
    "qwen3": "hermes",
    "qwen25": "hermes",
    "qwen": "hermes",
    "qwen3_xml": "qwen3_coder",
    "qwen3.5": "qwen3_coder",
    "deepseek_r1": "deepseek_v3",
    "deepseekv3": "deepseek_v3",
    "deepseekv31": "deepseek_v31",
    "deepseekv32": "deepseek_v32",
    "deepseekv4": "deepseek_v4",
    "deepseek-v4": "deepseek_v4",
    "glm": "glm45",
    "glm5": "glm47",
    "kimi": "kimi_k2",
    "openai": "harmony",
    "gpt-oss": "harmony",
    "gpt_oss": "harmony",
    "minimax": "minimax_m2",
    "minimax-m2": "minimax_m2",
}

# Template fingerprints, most specific first: (family, a regex the template contains).
_FINGERPRINTS = (
    # V4 ships no template (encoding_dsv4.py); one written for it names the `tool_calls` block
    ("deepseek_v4", re.escape("｜DSML｜tool_calls") + r"|dsml_token\s*\}\}\s*tool_calls"),
    ("deepseek_v32", re.escape("｜DSML｜")),
    ("harmony", re.escape("<|channel|>")),
    ("kimi_k2", re.escape("<|tool_calls_section_begin|>")),
    ("minimax_m2", re.escape("<minimax:tool_call>")),
    ("mistral", re.escape("[TOOL_CALLS]")),
    ("deepseek_v3", re.escape("<｜tool▁sep｜>") + r".*```json"),
    ("deepseek_v31", re.escape("<｜tool▁calls▁begin｜>")),
    ("glm47", re.escape("<arg_key>") + r"(?s:.*)else\s+'<think>'"),
    ("glm45", re.escape("<arg_key>")),
    ("qwen3_coder", re.escape("<function=")),
    ("hermes", re.escape("<tool_call>")),
)

MODEL_TYPES = {
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_next": "hermes",
    "qwen3_5": "qwen3_coder",
    "qwen3_5_moe": "qwen3_coder",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v32": "deepseek_v32",
    "deepseek_v4": "deepseek_v4",
    "kimi_k2": "kimi_k2",
    "glm4_moe": "glm45",
    "glm4_moe_lite": "glm47",
    "glm_moe_dsa": "glm47",
    "gpt_oss": "harmony",
    "minimax_m2": "minimax_m2",
    "mistral": "mistral",
    "mistral3": "mistral",
    "ministral": "mistral",
}


def family_name(name: str) -> str:
    """The family a parser name or alias means; ValueError listing the names for others."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in FAMILIES:
        known, aliases = ", ".join(sorted(FAMILIES)), ", ".join(sorted(ALIASES))
        raise ValueError(f"unknown parser family {name!r}; known: {known} (aliases: {aliases})")
    return key


def choose_family(model_type: str | None, chat_template: str | None) -> tuple[str | None, str]:
    """(family or None, why): the chat template's markers decide, the model_type otherwise."""
    if chat_template:
        for family, pattern in _FINGERPRINTS:
            if re.search(pattern, chat_template, re.DOTALL):
                return family, f"chat template has {family}'s tool-call markers"
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type], f"model_type {model_type}"
    return None, f"no parser knows model_type {model_type!r} or its chat template"


def make_parser(family: str, **kwargs) -> Parser:  # type: ignore[no-untyped-def]
    """A parser of `family` (a name or alias); kwargs as `Parser`."""
    return FAMILIES[family_name(family)](**kwargs)
