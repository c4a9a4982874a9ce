"""Raw model outputs per family, written from each family's chat template format
(../shared/chat-templates), with the message a parser must make of them. Each case names the
complaint class of research/serving.md §5 it covers (c1 calls inside reasoning, c3 argument types,
c4 edge syntax, c5 truncated or pre-filled reasoning, c8 ids, c10 markup leaking into content)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "ratio": {"type": "number"},
                    "note": {"type": ["string", "null"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object"}}},
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
]

FILE = 'def f(x):\n    return "<b>" + x  # 10 < 20, ünïcödé ✓\n'
WEATHER = {"city": "São Paulo", "days": 3, "metric": True, "hours": [6, 12], "ratio": 0.5}


@dataclass
class Case:
    family: str
    name: str
    raw: str
    content: str | None = None
    reasoning: str | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    starts_in_reasoning: bool = False
    ids: list[str] | None = None  # expected ids, where the family fixes them
    warns: bool = False
    parallel_tool_calls: bool = True
    call_offset: int = 0
    withdrawn: int = 0  # calls announced in the stream, then found broken (base.py)

    @property
    def id(self) -> str:
        return f"{self.family}-{self.name}"


CASES = [
    # -- hermes / qwen3 -------------------------------------------------------------------------
    Case(
        "hermes",
        "think-content-call",
        '<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": '
        '"get_weather", "arguments": {"city": "São Paulo", "days": 3, "metric": true, "hours": '
        '[6, 12], "ratio": 0.5}}\n</tool_call>',
        content="Let me check.",
        reasoning="The user wants weather.",
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "hermes",
        "c1-call-before-think-end",
        '<think>\nI should call the tool.\n<tool_call>\n{"name": "list_files", "arguments": {}}'
        "\n</tool_call>",
        reasoning="I should call the tool.",
        calls=[("list_files", {})],
    ),
    Case(
        "hermes",
        "c4-parallel-and-zero-args",
        '<tool_call>\n{"name": "list_files"}\n</tool_call>\n<tool_call>\n{"name": "write_file", '
        f'"arguments": {{"path": "a.py", "content": {json.dumps(FILE)}}}}}\n'
        "</tool_call>",
        calls=[("list_files", {}), ("write_file", {"path": "a.py", "content": FILE})],
    ),
    Case(
        "hermes",
        "parallel-off-keeps-first",
        '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        calls=[("list_files", {})],
        parallel_tool_calls=False,
    ),
    Case(
        "hermes",
        "c5-cut-in-reasoning",
        "<think>\nStill thinking about the answer",
        reasoning="Still thinking about the answer",
    ),
    Case(
        "hermes",
        "c5-prefilled-think",
        "Thinking already.\n</think>\n\nThe answer is 4.",
        content="The answer is 4.",
        reasoning="Thinking already.",
        starts_in_reasoning=True,
    ),
    Case(
        "hermes",
        "c4-cut-string-becomes-content",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        content='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        warns=True,
        withdrawn=1,
    ),
    Case(
        "hermes",
        "c4-missing-closing-brace-repaired",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2',
        calls=[("get_weather", {"city": "Paris", "days": 2})],
        warns=True,
    ),
    Case(
        "hermes",
        "not-json-stays-content",
        "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
        content="<tool_call>\nget_weather(city=Paris)\n</tool_call>",
        warns=True,
    ),
    Case(
        "hermes",
        "arguments-as-json-string",
        '<tool_call>\n{"arguments": "{\\"city\\": \\"Rome\\"}", "name": "get_weather"}\n'
        "</tool_call>",
        calls=[("get_weather", {"city": "Rome"})],
    ),
    Case(
        "hermes",
        "arguments-as-json-string-in-order",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n'
        "</tool_call>",
        calls=[("get_weather", {"city": "Rome"})],
    ),
    # -- qwen3_coder (Qwen3-Coder, Qwen3.5) -----------------------------------------------------
    Case(
        "qwen3_coder",
        "c3-typed-values",
        "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=hours>\n[6, 12]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "</function>\n</tool_call>",
        content="Checking.",
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "qwen3_coder",
        "c3-ambiguous-and-unknown-stay-strings",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n10\n</parameter>\n"
        "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n5\n</parameter>\n</function>\n"
        "</tool_call>",
        calls=[("get_weather", {"city": "10", "note": "null", "extra": "5"})],
    ),
    Case(
        "qwen3_coder",
        "long-string-value-and-parallel",
        f"<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
        f"<parameter=content>\n{FILE}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=list_files>\n</function>\n</tool_call>",
        calls=[("write_file", {"path": "a.py", "content": FILE}), ("list_files", {})],
    ),
    Case(
        "qwen3_coder",
        "c1-call-inside-think-qwen35",
        "The file must be listed first.\n<tool_call>\n<function=list_files>\n</function>\n"
        "</tool_call>",
        reasoning="The file must be listed first.",
        calls=[("list_files", {})],
        starts_in_reasoning=True,
    ),
    Case(
        "qwen3_coder",
        "c4-cut-inside-a-value-becomes-content",
        "Writing.\n<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
        "<parameter=content>\ndef f(",
        content="Writing.<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n"
        "</parameter>\n<parameter=content>\ndef f(",
        warns=True,
        withdrawn=1,
    ),
    Case(
        "qwen3_coder",
        "c4-cut-between-parameters-repaired",
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n",
        calls=[("write_file", {"path": "a.py"})],
        warns=True,
    ),
    Case(
        "qwen3_coder",
        "c4-missing-parameter-close",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n"
        "</function>\n</tool_call>",
        calls=[("get_weather", {"city": "Oslo", "days": 2})],
    ),
    # -- deepseek_v3 ----------------------------------------------------------------------------
    Case(
        "deepseek_v3",
        "c5-prefilled-think-and-fenced-call",
        "The user wants the weather.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
        "function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "São Paulo", "days": 3, "metric": true, "hours": [6, 12], "ratio": 0.5}\n```'
        "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>list_files\n```json\n{}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        reasoning="The user wants the weather.",
        calls=[("get_weather", WEATHER), ("list_files", {})],
        starts_in_reasoning=True,
    ),
    Case(
        "deepseek_v3",
        "c10-no-markup-in-content",
        "ok</think>Here you go.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "list_files\n```json\n{}\n```<｜tool▁call▁end｜>",
        content="Here you go.",
        reasoning="ok",
        calls=[("list_files", {})],
        starts_in_reasoning=True,
    ),
    # -- deepseek_v31 ---------------------------------------------------------------------------
    Case(
        "deepseek_v31",
        "non-thinking-calls",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "São Paulo", "days": 3, "metric": true, "hours": [6, 12], "ratio": 0.5}'
        "<｜tool▁call▁end｜><｜tool▁call▁begin｜>list_files<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        content="Sure.",
        calls=[("get_weather", WEATHER), ("list_files", {})],
    ),
    Case(
        "deepseek_v31",
        "c4-not-json-before-the-first-byte-is-content",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>city=Oslo"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        content="Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>city=Oslo"
        "<｜tool▁call▁end｜>",
        warns=True,
    ),
    Case(
        "deepseek_v31",
        "c5-thinking-kwarg",
        "Let me think.</think>4",
        content="4",
        reasoning="Let me think.",
        starts_in_reasoning=True,
    ),
    # -- deepseek_v32 (DSML) --------------------------------------------------------------------
    Case(
        "deepseek_v32",
        "string-attribute-types",
        "Need data.</think>Checking.\n\n<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">São Paulo</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="metric" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="hours" string="false">[6, 12]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="ratio" string="false">0.5</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        content="Checking.",
        reasoning="Need data.",
        calls=[("get_weather", WEATHER)],
        starts_in_reasoning=True,
    ),
    Case(
        "deepseek_v32",
        "tool-calls-variant-string-true-digits",
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">10</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="list_files">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        calls=[("get_weather", {"city": "10"}), ("list_files", {})],
    ),
    # -- deepseek_v4 (DSML in a tool_calls block; DeepSeek's encoding/encoding_dsv4.py) ----------
    Case(
        "deepseek_v4",
        "thinking-content-calls",
        "The user wants weather.</think>Checking.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">São Paulo</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="metric" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="hours" string="false">[6, 12]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="ratio" string="false">0.5</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n<｜DSML｜invoke name="list_files">\n\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>",
        content="Checking.",
        reasoning="The user wants weather.",
        calls=[("get_weather", WEATHER), ("list_files", {})],
        starts_in_reasoning=True,
    ),
    Case(
        "deepseek_v4",
        "c3-chat-mode-string-flag-decides",
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">10</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="note" string="false">null</｜DSML｜parameter>\n'
        f'<｜DSML｜parameter name="extra" string="true">{FILE}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        calls=[("get_weather", {"city": "10", "note": None, "extra": FILE})],
    ),
    Case(
        "deepseek_v4",
        "c5-cut-in-reasoning",
        "Still weighing <｜DSML｜tool_calls> against an answer",
        reasoning="Still weighing <｜DSML｜tool_calls> against an answer",
        starts_in_reasoning=True,
    ),
    # -- glm45 ----------------------------------------------------------------------------------
    Case(
        "glm45",
        "c3-typed-arg-values",
        "\n<think>I need the weather.</think>\nChecking.\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
        "<arg_key>hours</arg_key>\n<arg_value>[6, 12]</arg_value>\n<arg_key>ratio</arg_key>\n"
        "<arg_value>0.5</arg_value>\n</tool_call>",
        content="Checking.",
        reasoning="I need the weather.",
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "glm45",
        "c5-thinking-off",
        "\n<think></think>\nHello.",
        content="Hello.",
    ),
    # -- glm47 ----------------------------------------------------------------------------------
    Case(
        "glm47",
        "c4-zero-argument-call",
        "Listing first.</think><tool_call>list_files</tool_call><tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
        "<arg_value>2</arg_value></tool_call>",
        reasoning="Listing first.",
        calls=[("list_files", {}), ("get_weather", {"city": "Oslo", "days": 2})],
        starts_in_reasoning=True,
    ),
    Case(
        "glm47",
        "thinking-off-long-string",
        "Writing it.<tool_call>write_file<arg_key>path</arg_key><arg_value>a.py</arg_value>"
        f"<arg_key>content</arg_key><arg_value>{FILE}</arg_value></tool_call>",
        content="Writing it.",
        calls=[("write_file", {"path": "a.py", "content": FILE})],
    ),
    Case(
        "glm47",
        "c5-cut-in-reasoning",
        "I am still thinking about <tool_call> syntax",
        reasoning="I am still thinking about <tool_call> syntax",
        starts_in_reasoning=True,
    ),
    # -- kimi_k2 --------------------------------------------------------------------------------
    Case(
        "kimi_k2",
        "c8-ids-kept-and-counted",
        "<think>Weather first.</think>On it.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:4<|tool_call_argument_begin|>{"city": "São Paulo", "days": 3, '
        '"metric": true, "hours": [6, 12], "ratio": 0.5}<|tool_call_end|><|tool_call_begin|>'
        "call_x1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        content="On it.",
        reasoning="Weather first.",
        calls=[("get_weather", WEATHER), ("call_x1", {})],
        ids=["functions.get_weather:4", "functions.call_x1:5"],
        call_offset=4,
    ),
    Case(
        "kimi_k2",
        "c4-syntax-error-after-streaming-then-a-good-call",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo", "days": three}<|tool_call_end|>'
        "<|tool_call_begin|>functions.list_files:1<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        content="<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo", "days": three}<|tool_call_end|>',
        calls=[("list_files", {})],
        ids=["functions.list_files:1"],
        warns=True,
        withdrawn=1,
    ),
    Case(
        "kimi_k2",
        "c1-c4-call-in-think-singular-section",
        "<think>I must list files.<|tool_call_section_begin|><|tool_call_begin|>"
        "functions.list_files:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_call_section_end|>",
        reasoning="I must list files.",
        calls=[("list_files", {})],
        ids=["functions.list_files:0"],
    ),
    # -- harmony (gpt-oss) ----------------------------------------------------------------------
    Case(
        "harmony",
        "analysis-then-call",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        "commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "São Paulo", "days": 3, "metric": true, "hours": [6, 12], "ratio": 0.5}',
        reasoning="Need the weather.",
        calls=[("get_weather", WEATHER)],
    ),
    Case(
        "harmony",
        "analysis-then-final",
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
        "<|message|>2 + 2 = 4.",
        content="2 + 2 = 4.",
        reasoning="Simple.",
    ),
    Case(
        "harmony",
        "recipient-before-channel-and-preamble",
        "<|channel|>commentary<|message|>Listing now.<|end|><|start|>assistant to=functions."
        "list_files<|channel|>commentary json<|message|>{}<|call|>",
        content="Listing now.",
        calls=[("list_files", {})],
    ),
    # -- minimax_m2 -----------------------------------------------------------------------------
    Case(
        "minimax_m2",
        "c5-prefilled-think-typed-call",
        'The user wants weather.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">'
        '<parameter name="city">São Paulo</parameter><parameter name="days">3</parameter>'
        '<parameter name="metric">true</parameter><parameter name="hours">[6, 12]</parameter>'
        '<parameter name="ratio">0.5</parameter></invoke>\n<invoke name="list_files"></invoke>\n'
        "</minimax:tool_call>",
        reasoning="The user wants weather.",
        calls=[("get_weather", WEATHER), ("list_files", {})],
        starts_in_reasoning=True,
    ),
    # -- mistral --------------------------------------------------------------------------------
    Case(
        "mistral",
        "new-form-two-calls",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "São Paulo", "days": 3, "metric": true, '
        '"hours": [6, 12], "ratio": 0.5}[TOOL_CALLS]list_files[ARGS]{}',
        calls=[("get_weather", WEATHER), ("list_files", {})],
    ),
    Case(
        "mistral",
        "old-form-list",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "list_files", "arguments": {}}]',
        calls=[("get_weather", {"city": "Oslo"}), ("list_files", {})],
    ),
    Case(
        "mistral",
        "magistral-think-then-call-id",
        "[THINK]Weather.[/THINK]Sure.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]"
        '{"city": "Oslo"}',
        content="Sure.",
        reasoning="Weather.",
        calls=[("get_weather", {"city": "Oslo"})],
        ids=["a1B2c3D4e"],
    ),
]
