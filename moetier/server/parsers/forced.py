"""The grammar of a forced tool call (`tool_choice` required or named) in the model family's own
call syntax, so the model writes the markers it was trained on and its family's parser reads
them: Kimi's section tokens, DeepSeek's tool tokens, harmony's commentary channel, Mistral's
[TOOL_CALLS], Hermes' <tool_call>. Families whose arguments are not one JSON object (the
XML-style ones) are forced in the Hermes form (engine/grammar.py `tool_call_grammar`) and read
by the Hermes parser.

The arguments are `%json` of the tool's parameters schema (llguidance), written as json.dumps
writes JSON; a marker that is one of the tokenizer's added tokens must be that token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from moetier.engine.grammar import JSON_OPTIONS, check_grammar, closed_objects, tool_call_grammar
from moetier.server.parsers import deepseek_v3 as ds
from moetier.server.parsers import kimi_k2 as kimi

# The Hermes form the XML-style families are forced in (the grammar and the parser agree on it).
FORCED_BEGIN, FORCED_END = "<tool_call>\n", "\n</tool_call>"
_EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}


def _hermes(name: str, idx: str) -> tuple[str, str]:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"


def _deepseek_v3(name: str, idx: str) -> tuple[str, str]:
    return f"{ds.CALL_BEGIN}function{ds.SEP}{name}\n```json\n", f"\n```{ds.CALL_END}"


def _deepseek_v31(name: str, idx: str) -> tuple[str, str]:
    return f"{ds.CALL_BEGIN}{name}{ds.SEP}", ds.CALL_END


def _kimi(name: str, idx: str) -> tuple[str, str]:
    return f"{kimi.CALL_BEGIN}functions.{name}:\x00{idx}\x00{kimi.ARGS_BEGIN}", kimi.CALL_END


def _harmony(name: str, idx: str) -> tuple[str, str]:
    # the call ends with <|call|>, an end token: the grammar's end lets only end tokens follow
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""


def _mistral(name: str, idx: str) -> tuple[str, str]:
    return f"[TOOL_CALLS]{name}[ARGS]", ""


# family -> (text before the calls, one call's text around its arguments, between calls, after)
NATIVE: dict[str, tuple[str, Callable[[str, str], tuple[str, str]], str, str]] = {
    "hermes": ("", _hermes, "\n", ""),
    "deepseek_v3": (ds.CALLS_BEGIN, _deepseek_v3, "\n", ds.CALLS_END),
    "deepseek_v31": (ds.CALLS_BEGIN, _deepseek_v31, "", ds.CALLS_END),
    "kimi_k2": (kimi.SECTION_BEGIN[0], _kimi, "", kimi.SECTION_END[0]),
    "harmony": ("", _harmony, "", ""),
    "mistral": ("", _mistral, "", ""),
}
SINGLE_CALL = {"harmony"}  # one call per answer: <|call|> ends it


def _chosen(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, dict[str, Any]]:
    """Name -> parameters schema of the tools `tool_choice` allows; ValueError as
    tool_call_grammar raises it."""
    named: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("each tool needs a function name")
        schema = fn.get("parameters", fn.get("input_schema"))
        if schema is not None and not isinstance(schema, dict):
            raise ValueError(f"the parameters of tool {fn['name']!r} must be a JSON schema object")
        named[fn["name"]] = schema or _EMPTY
    if tool_choice in ("required", "any") or (
        isinstance(tool_choice, dict) and tool_choice.get("type") == "any"
    ):
        if not named:
            raise ValueError("tool_choice forces a tool call, but the request has no tools")
        return named
    fn = (tool_choice.get("function") or tool_choice) if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice {tool_choice!r}: use auto, none, required or a named tool")
    if name not in named:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return {name: named[name]}


def forced_call_grammar(
    family: str | None,
    tools: list[dict[str, Any]],
    tool_choice: Any,
    parallel: bool,
    tokenizer: Any,
    call_offset: int = 0,
) -> tuple[tuple[str, str], str]:
    """((kind, spec) of the forced call's grammar, the family whose parser reads it); ValueError
    (the client's 400) for a tool_choice that forces nothing it can, or a forced tool whose
    parameters the grammar engine cannot enforce (found here, before the request is queued)."""
    chosen = _chosen(tools, tool_choice)
    for name, schema in chosen.items():
        try:
            check_grammar("json_schema", json.dumps(schema))
        except ValueError as err:
            raise ValueError(
                f"tool_choice forces a call to {name!r}, whose parameters schema cannot be "
                f"enforced: {err}"
            ) from err
    if family not in NATIVE:
        grammar = tool_call_grammar(
            tools, tool_choice, FORCED_BEGIN, FORCED_END, parallel=parallel, tokenizer=tokenizer
        )
        assert grammar is not None
        return grammar, "hermes"
    prefix, around, sep, suffix = NATIVE[family]
    parallel = parallel and family not in SINGLE_CALL
    added = tokenizer.get_added_vocab() if tokenizer is not None else {}
    alternatives = []
    for name, schema in chosen.items():
        begin, end = around(name, str(call_offset) if not parallel else "")
        args = json.dumps({**closed_objects(schema), "x-guidance": JSON_OPTIONS})
        alternatives.append(f"{_lark(begin, added)} %json {args} {_lark(end, added)}")
    rules = [f"call_{i}: {alt}" for i, alt in enumerate(alternatives)]
    calls = f"call ({_lark(sep, added)} call)*" if parallel else "call"
    start = f"start: {_lark(prefix, added)} {calls} {_lark(suffix, added)}"
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(alternatives)))
    return ("ebnf", "\n".join([start, call, *rules]) + "\n"), family


def _lark(text: str, added: dict[str, int]) -> str:
    """Lark items matching `text`: its added tokens by id (<[id]>), the rest as string literals;
    a \\x00-delimited empty field is a call index (digits)."""
    if not text:
        return ""
    items = []
    for k, part in enumerate(text.split("\x00")):
        if k % 2 == 1:  # an index field
            items.append(json.dumps(part) if part else "/[0-9]+/")
            continue
        if not part:
            continue
        pieces = [part]
        if added:
            tokens = sorted(added, key=len, reverse=True)
            pieces = re.split("(" + "|".join(re.escape(t) for t in tokens) + ")", part)
        items += [f"<[{added[p]}]>" if p in added else json.dumps(p) for p in pieces if p]
    return " ".join(items)
