"""The real chat templates (/work/shared/chat-templates) through transformers' renderer:
conversations with reasoning and tool calls in history render; the registry recognises each
template; and an assistant turn the template renders, parsed back by its family's parser, gives
the same calls (round trip)."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import SHARED
from parser_cases import TOOLS
from transformers.utils.chat_template_utils import render_jinja_template

from moetier.server.parsers import choose_family, make_parser

TEMPLATES = SHARED / "chat-templates"
if not TEMPLATES.is_dir():  # the shared folder of the development machines
    pytest.skip("no shared chat templates here", allow_module_level=True)

ARGS = {"city": "São Paulo", "days": 3, "metric": True, "hours": [6, 12]}
# file -> (family, tool-call arguments as the template needs them: a mapping or a JSON string,
#          the text the assistant turn begins after, the text it ends at, calls per message)
SPECS = {
    "qwen3.jinja": ("hermes", "map", "<|im_start|>assistant\n", "<|im_end|>", 2),
    "qwen3-coder.jinja": ("qwen3_coder", "map", "<|im_start|>assistant\n", "<|im_end|>", 2),
    "qwen3.5.jinja": ("qwen3_coder", "map", "<|im_start|>assistant\n", "<|im_end|>", 2),
    "deepseek-v3.jinja": ("deepseek_v3", "str", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", 2),
    "deepseek-v3.1.jinja": ("deepseek_v31", "str", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", 2),
    "deepseek-v3.2.jinja": ("deepseek_v32", "map", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", 2),
    "glm-4.5.jinja": ("glm45", "map", "<|assistant|>", "<|observation|>", 2),
    "glm-4.6.jinja": ("glm45", "map", "<|assistant|>", "<|observation|>", 2),
    "glm-4.7.jinja": ("glm47", "map", "<|assistant|>", "<|observation|>", 2),
    "glm-5.jinja": ("glm47", "map", "<|assistant|>", "<|observation|>", 2),
    "kimi-k2.jinja": ("kimi_k2", "map", "<|im_middle|>", "<|im_end|>", 2),
    "kimi-k2-thinking.jinja": ("kimi_k2", "map", "<|im_middle|>", "<|im_end|>", 2),
    "gpt-oss.jinja": ("harmony", "map", "<|start|>assistant", "<|start|>functions", 1),
    "minimax-m2.jinja": ("minimax_m2", "map", "]~b]ai\n", "[e~[", 2),
    "mistral.jinja": ("mistral", "map", "[/INST]", "</s>", 2),
}
# transformers renders templates in jinja2's ImmutableSandboxedEnvironment (vLLM and SGLang
# render through it too). This Kimi-K2-Instruct copy (an ik_llama.cpp mirror; llama.cpp's own
# Jinja engine allows it) keeps a queue of call ids in namespace(ids=[]) and calls .append on
# it for every tool call and .pop(0) for every tool result, whatever the arguments' shape, so
# no shaping of the history avoids it; allowing it would mean a mutable sandbox. Moonshot's
# Kimi-K2-Thinking template (kimi-k2-thinking.jinja) reads message.tool_call_id instead and
# renders. Its history with tool calls is therefore a 400 with the template's error.
REFUSED = {"kimi-k2.jinja": "transformers' immutable sandbox refuses the template's list.append"}
TOOLS_DESCRIBED = [
    {**t, "function": {**t["function"], "description": "a tool"}} for t in TOOLS
]  # gpt-oss's template prints every tool's description


def _conversation(args_as: str, family: str, with_result: bool) -> list[dict]:
    def arguments(value: dict):
        return value if args_as == "map" else json.dumps(value, ensure_ascii=False)

    ids = (
        ["abcdefgh1", "abcdefgh2"]
        if family == "mistral"
        else ["functions.get_weather:0", "functions.list_files:1"]
    )
    messages: list[dict] = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in São Paulo?"},
        {
            "role": "assistant",
            "content": None if family == "deepseek_v3" else "",
            "reasoning_content": "Need the tool.",
            "thinking": "Need the tool.",
            "tool_calls": [
                {
                    "id": ids[0],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments(ARGS)},
                },
                {
                    "id": ids[1],
                    "type": "function",
                    "function": {"name": "list_files", "arguments": arguments({})},
                },
            ],
        },
    ]
    if with_result:
        messages += [
            {"role": "tool", "tool_call_id": ids[0], "name": "get_weather", "content": "Sunny."},
            {"role": "tool", "tool_call_id": ids[1], "name": "list_files", "content": "a.py"},
            {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Done."},
            {"role": "user", "content": "Thanks."},
        ]
    return messages


def _render(name: str, messages: list[dict], generation: bool, **kwargs) -> str:
    rendered, _ = render_jinja_template(
        [copy.deepcopy(messages)],
        tools=TOOLS_DESCRIBED,
        chat_template=(TEMPLATES / name).read_text(),
        add_generation_prompt=generation,
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="</s>",
        **kwargs,
    )
    return rendered[0]


def _params(names):
    return [
        pytest.param(n, marks=pytest.mark.xfail(reason=REFUSED[n], strict=True))
        if n in REFUSED
        else n
        for n in names
    ]


def test_every_template_is_covered():
    assert {p.name for p in TEMPLATES.glob("*.jinja")} == set(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_registry_recognises_template(name):
    family, *_ = SPECS[name]
    assert choose_family(None, (TEMPLATES / name).read_text())[0] == family


@pytest.mark.parametrize("name", _params(sorted(SPECS)))
@pytest.mark.parametrize("thinking", [None, True, False])
def test_history_with_calls_and_reasoning_renders(name, thinking):
    family, args_as, *_ = SPECS[name]
    kwargs = {} if thinking is None else {"enable_thinking": thinking, "thinking": thinking}
    prompt = _render(name, _conversation(args_as, family, with_result=True), True, **kwargs)
    assert "Sunny." in prompt and "get_weather" in prompt


@pytest.mark.parametrize("name", _params(sorted(SPECS)))
def test_rendered_calls_parse_back(name):
    family, args_as, start, end, per_message = SPECS[name]
    text = _render(name, _conversation(args_as, family, with_result=False), False)
    turn = text[text.rindex("Weather in São Paulo?") :]
    turn = turn[turn.index(start) + len(start) :]
    turn = turn.split(end)[0]
    message = make_parser(family, tools=TOOLS).parse(turn)
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls
    ]
    assert calls == [("get_weather", ARGS), ("list_files", {})][:per_message], turn
    assert [type(v) for v in calls[0][1].values()] == [str, int, bool, list]
    if "Need the tool." in turn:
        assert message.reasoning_content == "Need the tool."
    assert message.content is None, turn
    assert not message.warnings


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("thinking", [True, False])
def test_generation_prompt_sets_the_reasoning_state(name, thinking):
    """c5: where a template opens (or closes) the reasoning block in the generation prompt, the
    parser starts in (or out of) reasoning; the thinking switch decides for hybrid templates."""
    family, args_as, *_ = SPECS[name]
    messages = [{"role": "user", "content": "Hi"}]
    prompt = _render(name, messages, True, enable_thinking=thinking, thinking=thinking)
    parser = make_parser(family)
    starts = type(parser).prompt_ends_in_reasoning(prompt)  # type: ignore[attr-defined]
    opens = {
        "qwen3.5.jinja",
        "deepseek-v3.jinja",
        "deepseek-v3.2.jinja",
        "glm-4.7.jinja",
        "glm-5.jinja",
        "minimax-m2.jinja",
        "deepseek-v3.1.jinja",
    }
    hybrid = {
        "qwen3.5.jinja",
        "deepseek-v3.2.jinja",
        "glm-4.7.jinja",
        "glm-5.jinja",
        "deepseek-v3.1.jinja",
    }
    assert starts == (name in opens and (thinking or name not in hybrid))


# Templates that render the reasoning of the turn after the last user message (an agent's tool
# loop): read from their sources (reasoning_content / gpt-oss's thinking, last_user_index /
# last_query_index / Kimi's suffix); the others never render the history's reasoning.
KEEPS_CURRENT_TURN = {
    "qwen3.jinja",
    "qwen3.5.jinja",
    "deepseek-v3.2.jinja",
    "glm-4.5.jinja",
    "glm-4.6.jinja",
    "glm-4.7.jinja",
    "glm-5.jinja",
    "kimi-k2-thinking.jinja",
    "minimax-m2.jinja",
    "gpt-oss.jinja",
}
THOUGHT = "Need the tool, thought 7."


def _tool_loop(form: str, family: str) -> list[dict]:
    """user, assistant (reasoning + a call), tool result: as each API hands it to the server."""
    from moetier.server import anthropic, responses

    call_id = "abcdefgh1" if family == "mistral" else "functions.get_weather:0"
    args = {"city": "Oslo"}
    if form == "anthropic":
        return anthropic.chat_messages(
            "You are helpful.",
            [
                anthropic.Message(role="user", content="Weather in Oslo?"),
                anthropic.Message(
                    role="assistant",
                    content=[
                        {"type": "thinking", "thinking": THOUGHT, "signature": ""},
                        {"type": "tool_use", "id": call_id, "name": "get_weather", "input": args},
                    ],
                ),
                anthropic.Message(
                    role="user",
                    content=[{"type": "tool_result", "tool_use_id": call_id, "content": "Sunny."}],
                ),
            ],
        )
    if form == "responses":
        items = [
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "get_weather",
                "arguments": json.dumps(args),
            },
            {"type": "function_call_output", "call_id": call_id, "output": "Sunny."},
        ]
        return responses.chat_messages(
            "You are helpful.", [responses.InputItem(**i) for i in items]
        )
    return [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            form: THOUGHT,  # reasoning_content, or vLLM's newer `reasoning`
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": "Sunny."},
    ]


def _served_render(name: str, messages: list[dict], kwargs: dict | None = None) -> str:
    """The prompt as prepare_chat renders it: reasoning_history applied, history shaped."""
    from moetier.server.parsers.serving import reasoning_history_kwargs, template_history

    family = SPECS[name][0]
    kwargs = reasoning_history_kwargs(kwargs, family)
    keep = kwargs.pop("reasoning_history") != "drop"
    return _render(name, template_history(messages, family, reasoning=keep), True, **kwargs)


@pytest.mark.parametrize("name", _params(sorted(SPECS)))
@pytest.mark.parametrize("form", ["reasoning_content", "reasoning", "anthropic", "responses"])
def test_history_reasoning_reaches_templates_that_keep_it(name, form):
    """#44 rendering: the history's reasoning, in each API's form, reaches the template; it is in
    the prompt exactly where the family's own template keeps it (the default)."""
    prompt = _served_render(name, _tool_loop(form, SPECS[name][0]))
    assert "Sunny." in prompt
    assert (THOUGHT in prompt) == (name in KEEPS_CURRENT_TURN), prompt


@pytest.mark.parametrize("name", _params(sorted(SPECS)))
def test_reasoning_history_drop(name):
    messages = _tool_loop("reasoning_content", SPECS[name][0])
    prompt = _served_render(name, messages, {"reasoning_history": "drop"})
    assert "Sunny." in prompt and THOUGHT not in prompt


@pytest.mark.parametrize("name", sorted(SPECS))  # no tool calls: Kimi-K2's renders too
def test_reasoning_history_keep(name):
    """ "keep" sets the family's switch for every turn's reasoning (GLM-4.7 / 5 clear_thinking);
    a turn before the last user message keeps its reasoning there, elsewhere the template's own
    choice stands (the prompt is the default's)."""
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello.", "reasoning_content": THOUGHT},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    kept = _served_render(name, messages, {"reasoning_history": "keep"})
    default = _served_render(name, messages)
    assert THOUGHT not in default
    if name in ("glm-4.7.jinja", "glm-5.jinja"):
        assert THOUGHT in kept
    else:
        assert kept == default


def test_reasoning_history_is_checked():
    from moetier.server.parsers.serving import reasoning_history_kwargs

    with pytest.raises(ValueError, match="reasoning_history 'all'"):
        reasoning_history_kwargs({"reasoning_history": "all"}, "hermes")
    assert reasoning_history_kwargs({"clear_thinking": True, "reasoning_history": "keep"}, "glm47")[
        "clear_thinking"
    ]  # the request's own switch wins
