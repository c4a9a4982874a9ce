"""DeepSeek-V4 prompts without a Jinja template (server/renderers/deepseek_v4.py) against
DeepSeek's encoder, `encode_messages` in `encoding/encoding_dsv4.py` of the DeepSeek-V4-Flash /
Pro repositories.

The expected strings are written by hand from published encoder outputs:
- ms-swift's alignment test tests/test_align/test_template/test_deepseek_v4_flash.py
  (modelscope/ms-swift), whose strings it checks byte for byte against the model repository's
  `encoding/tests/test_output_1.txt` (thinking, tools, a call and its result) and
  `test_output_2.txt` (thinking, earlier reasoning dropped), and its cases "tools keep every
  turn's reasoning", "parallel calls" and "chat mode";
- the encoder's source (the copy in supermy/ds4rs encoding/encoding_dsv4.py): the
  maximum-effort instruction first in thinking mode, `string="false"` values as JSON written
  with ensure_ascii False, an empty invoke body for a call without arguments, tool results put
  in the order of the calls (`sort_tool_results_by_call_order`), user turns merged with a blank
  line (`merge_tool_messages`), `wo_eos` for an open last assistant turn.
Then: a round trip through the deepseek_v4 parser, the choice of renderer, prepare_chat's ids,
and the real server with a tiny deepseek_v4 store whose chat template was removed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from moetier.server.parsers.deepseek_v4 import DeepSeekV4Parser
from moetier.server.renderers import renderer_for
from moetier.server.renderers.deepseek_v4 import render

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "You are a helpful assistant."
THINKING = {"thinking": True}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a specific location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city name"},
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "Temperature unit",
                    },
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web for information",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Search query"},
                    "num_results": {
                        "type": "integer",
                        "description": "Number of results to return",
                    },
                },
                "required": ["query"],
            },
        },
    },
]
# the tools section as test_output_1.txt has it (ms-swift's TOOLS_SECTION, written out)
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. '
    "For all other types (numbers, booleans, arrays, objects), "
    'pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), "
    "you MUST output your complete reasoning inside <think>...</think> "
    "BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Get the weather for a specific location", '
    '"parameters": {"type": "object", "properties": {"location": {"type": "string", '
    '"description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", '
    '"fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}\n'
    '{"name": "search", "description": "Search the web for information", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string", '
    '"description": "Search query"}, "num_results": {"type": "integer", '
    '"description": "Number of results to return"}}, "required": ["query"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas "
    "to invoke tool calls.\n"
)
EFFORT_MAX = (  # the encoder's REASONING_EFFORT_MAX
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)


def call(name: str, arguments: dict | str, id: str = "") -> dict:
    """An OpenAI tool call of the history (arguments a JSON string, as clients send them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": id, "type": "function", "function": {"name": name, "arguments": args}}


def invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜invoke>"


def param(key: str, value: str, string: bool = True) -> str:
    flag = "true" if string else "false"
    return f'<｜DSML｜parameter name="{key}" string="{flag}">{value}</｜DSML｜parameter>'


def calls_block(*invokes: str) -> str:
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


# -- prompts against the encoder's published outputs -------------------------------------------


def test_output_1_thinking_with_a_tool_call():
    """encoding/tests/test_output_1.txt: tools on the system message, the call in DSML after a
    blank line, the result as a user turn's <tool_result>, every turn's reasoning kept."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What's the weather in Beijing?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The user wants to know the weather in Beijing. "
            "I should use the get_weather tool.",
            "tool_calls": [call("get_weather", {"location": "Beijing", "unit": "celsius"})],
        },
        {
            "role": "tool",
            "tool_call_id": "",
            "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}',
        },
        {
            "role": "assistant",
            "reasoning_content": "Got the weather data. Let me format a nice response.",
            "content": "The weather in Beijing is currently sunny with a temperature of 22°C "
            "and 45% humidity.",
        },
    ]
    expected = (
        f"{BOS}{SYSTEM}\n\n{TOOLS_SECTION}"
        f"{USER}What's the weather in Beijing?{ASSISTANT}"
        "<think>The user wants to know the weather in Beijing. "
        "I should use the get_weather tool.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
        f'{USER}<tool_result>{{"temperature": 22, "condition": "sunny", "humidity": 45}}'
        f"</tool_result>{ASSISTANT}"
        "<think>Got the weather data. Let me format a nice response.</think>"
        "The weather in Beijing is currently sunny with a temperature of 22°C and 45% "
        f"humidity.{EOS}"
    )
    assert render(messages, TOOLS, THINKING) == expected
    # the history as prepare_chat hands it over (arguments a mapping): the same prompt
    shaped = [dict(m) for m in messages]
    shaped[2] = {**shaped[2], "tool_calls": [dict(shaped[2]["tool_calls"][0])]}
    shaped[2]["tool_calls"][0]["function"] = {
        "name": "get_weather",
        "arguments": {"location": "Beijing", "unit": "celsius"},
    }
    assert render(shaped, TOOLS, THINKING) == expected


THINKING_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hello"},
    {
        "role": "assistant",
        "reasoning_content": "The user said hello, I should greet back.",
        "content": "Hi there! How can I help you?",
    },
    {"role": "user", "content": "What is the capital of France?"},
]


def test_output_2_thinking_drops_earlier_reasoning():
    """encoding/tests/test_output_2.txt: without tools, the reasoning of turns before the last
    user turn is dropped (a bare </think> after their <｜Assistant｜>)."""
    last = {
        "role": "assistant",
        "reasoning_content": "The user asks about the capital of France. It is Paris.",
        "content": "The capital of France is Paris.",
    }
    history = (
        f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}</think>Hi there! How can I help you?{EOS}"
        f"{USER}What is the capital of France?{ASSISTANT}"
    )
    assert render([*THINKING_TURNS, last], None, THINKING) == (
        history + "<think>The user asks about the capital of France. It is Paris.</think>"
        f"The capital of France is Paris.{EOS}"
    )
    # the generation prompt (ms-swift's generation-prompt case): thinking opens
    assert render(THINKING_TURNS, None, THINKING) == history + "<think>"
    assert render(THINKING_TURNS, None, {"enable_thinking": True}) == history + "<think>"


def test_chat_mode_closes_thinking_everywhere():
    """thinking_mode chat (the default, and thinking false): </think> right after each
    <｜Assistant｜>, no reasoning written even where the history has it."""
    expected = (
        f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}</think>Hi there! How can I help you?{EOS}"
        f"{USER}What is the capital of France?{ASSISTANT}</think>"
    )
    assert render(THINKING_TURNS) == expected
    assert render(THINKING_TURNS, None, {"thinking": False, "enable_thinking": False}) == expected


def test_tools_keep_every_turns_reasoning():
    """ms-swift's 'tools keep history thinking': with tools the encoder turns drop_thinking
    off, so a turn before the last user message keeps <think>REASONING</think>."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What's the weather in Beijing?"},
        {
            "role": "assistant",
            "reasoning_content": "Need the get_weather tool.",
            "content": "",
            "tool_calls": [call("get_weather", {"location": "Beijing"})],
        },
        {"role": "tool", "content": '{"temperature": 22}'},
        {
            "role": "assistant",
            "reasoning_content": "Got it, answer now.",
            "content": "It is 22°C in Beijing.",
        },
        {"role": "user", "content": "And Shanghai?"},
    ]
    expected = (
        f"{BOS}{SYSTEM}\n\n{TOOLS_SECTION}"
        f"{USER}What's the weather in Beijing?{ASSISTANT}"
        "<think>Need the get_weather tool.</think>"
        + calls_block(invoke("get_weather", param("location", "Beijing")))
        + f"{EOS}"
        f'{USER}<tool_result>{{"temperature": 22}}</tool_result>{ASSISTANT}'
        f"<think>Got it, answer now.</think>It is 22°C in Beijing.{EOS}"
        f"{USER}And Shanghai?{ASSISTANT}<think>"
    )
    assert render(messages, TOOLS, THINKING) == expected
    # reasoning_history keep (drop_thinking false) does the same without tools
    kept = render(THINKING_TURNS, None, {**THINKING, "drop_thinking": False})
    assert kept == (
        f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}<think>The user said hello, I should greet back."
        f"</think>Hi there! How can I help you?{EOS}"
        f"{USER}What is the capital of France?{ASSISTANT}<think>"
    )


def test_parallel_calls_results_in_call_order():
    """ms-swift's parallel case (two results in one user turn, a blank line between), and the
    encoder's sort_tool_results_by_call_order: results sent out of order by id are put back
    in the order of the calls."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "weather in Beijing and Shanghai?"},
        {
            "role": "assistant",
            "reasoning_content": "Two cities, call the tool twice.",
            "content": "Let me check both.",
            "tool_calls": [
                call("get_weather", {"location": "Beijing"}, id="call_a"),
                call("get_weather", {"location": "Shanghai"}, id="call_b"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_b", "content": '{"temperature": 26}'},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": 22}'},
        {
            "role": "assistant",
            "reasoning_content": "Both done.",
            "content": "Beijing 22°C, Shanghai 26°C.",
        },
    ]
    expected = (
        f"{BOS}{SYSTEM}\n\n{TOOLS_SECTION}"
        f"{USER}weather in Beijing and Shanghai?{ASSISTANT}"
        "<think>Two cities, call the tool twice.</think>Let me check both.\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Shanghai</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
        f'{USER}<tool_result>{{"temperature": 22}}</tool_result>\n\n'
        f'<tool_result>{{"temperature": 26}}</tool_result>{ASSISTANT}'
        f"<think>Both done.</think>Beijing 22°C, Shanghai 26°C.{EOS}"
    )
    assert render(messages, TOOLS, THINKING) == expected


def test_typed_values_and_a_call_without_arguments():
    """encode_arguments_to_dsml: strings as they are (string="true"), everything else JSON
    with non-ASCII kept (string="false"), in the arguments' order; no arguments: an empty
    line inside the invoke. Chat mode: no reasoning written for the turn."""
    args = {"city": "São Paulo", "days": 3, "metric": True, "hours": [6, 12], "opt": None}
    args["filter"] = {"kind": "rain", "min": 0.5}
    messages = [
        {"role": "user", "content": "Plan my week."},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "not written in chat mode",
            "tool_calls": [call("get_weather", args), call("list_files", "{}")],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "a.txt"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]
    expected = (
        f"{BOS}{USER}Plan my week.{ASSISTANT}</think>Checking."
        + calls_block(
            invoke(
                "get_weather",
                param("city", "São Paulo"),
                param("days", "3", False),
                param("metric", "true", False),
                param("hours", "[6, 12]", False),
                param("opt", "null", False),
                param("filter", '{"kind": "rain", "min": 0.5}', False),
            ),
            invoke("list_files"),
        )
        + f"{EOS}{USER}<tool_result>sunny</tool_result>\n\n<tool_result>a.txt</tool_result>"
        f"\n\nThanks. And tomorrow?{ASSISTANT}</think>"
    )
    assert render(messages) == expected
    assert invoke("list_files") == '<｜DSML｜invoke name="list_files">\n\n</｜DSML｜invoke>'


def test_tools_without_a_system_message_and_effort_max():
    """No system message: the tools go on an empty one put first (what vLLM's DeepSeek-V4
    tokenizer hands the encoder), so the section follows a blank line; reasoning_effort max
    puts REASONING_EFFORT_MAX before the first message in thinking mode only."""
    user = [{"role": "user", "content": "Hi"}]
    assert render(user, TOOLS, THINKING) == (f"{BOS}\n\n{TOOLS_SECTION}{USER}Hi{ASSISTANT}<think>")
    effort = {**THINKING, "reasoning_effort": "max"}
    assert render(user, None, effort) == f"{BOS}{EFFORT_MAX}{USER}Hi{ASSISTANT}<think>"
    assert render(user, None, {"reasoning_effort": "max"}) == f"{BOS}{USER}Hi{ASSISTANT}</think>"
    assert render(user, None, {**THINKING, "reasoning_effort": "high"}) == (
        f"{BOS}{USER}Hi{ASSISTANT}<think>"
    )
    with pytest.raises(ValueError, match="reasoning_effort 'low'"):
        render(user, None, {**THINKING, "reasoning_effort": "low"})


def test_continued_assistant_turn_and_merged_user_turns():
    """wo_eos: a continued last assistant turn ends without <｜end▁of▁sentence｜>; consecutive
    user messages are one user turn (merge_tool_messages), a blank line between."""
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "user", "content": "Be brief."},
        {"role": "assistant", "content": "The answer"},
    ]
    assert render(messages, None, None, continue_final=True) == (
        f"{BOS}{USER}2+2?\n\nBe brief.{ASSISTANT}</think>The answer"
    )
    assert render(messages, None, THINKING, continue_final=True) == (
        f"{BOS}{USER}2+2?\n\nBe brief.{ASSISTANT}<think></think>The answer"
    )
    with pytest.raises(ValueError, match="no 'function' role"):
        render([{"role": "function", "content": "x"}])


# -- round trip through the parser -------------------------------------------------------------


def test_round_trip_through_the_parser():
    """An assistant turn with calls, rendered, then its completion (after the generation
    prompt's <think>, before the end of sentence) parsed by the deepseek_v4 parser: the same
    reasoning, content and calls (types from the string flags)."""
    weather = {"city": "São Paulo", "days": 3, "metric": False, "hours": [6, 12], "note": None}
    calls = [call("get_weather", weather, id="call_1"), call("list_files", {})]
    turn = {
        "role": "assistant",
        "reasoning_content": "Weather first, then files.",
        "content": "Checking both.",
        "tool_calls": calls,
    }
    prompt = render([{"role": "user", "content": "Go."}, turn], TOOLS, THINKING)
    head = f"{BOS}\n\n{TOOLS_SECTION}{USER}Go.{ASSISTANT}<think>"
    assert prompt.startswith(head) and prompt.endswith(EOS)
    completion = prompt[len(head) : -len(EOS)]
    message = DeepSeekV4Parser(TOOLS, starts_in_reasoning=True).parse(completion)
    assert message.reasoning_content == "Weather first, then files."
    assert message.content == "Checking both."
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls
    ]
    assert got == [("get_weather", weather), ("list_files", {})]
    assert not message.warnings


# -- which prompts it renders ------------------------------------------------------------------


def test_renderer_only_for_deepseek_v4_without_a_template():
    assert renderer_for("deepseek_v4", SimpleNamespace(chat_template=None)) is render
    assert renderer_for("deepseek_v4", SimpleNamespace()) is render
    assert renderer_for("deepseek_v4", SimpleNamespace(chat_template="{{ x }}")) is None
    assert renderer_for("deepseek_v3", SimpleNamespace(chat_template=None)) is None
    assert renderer_for(None, SimpleNamespace(chat_template=None)) is None


@pytest.fixture(scope="module")
def plain_tokenizer():
    from tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def _engine(tokenizer, model_type="deepseek_v4"):
    loaded = SimpleNamespace(model_config=SimpleNamespace(model_type=model_type))
    return SimpleNamespace(
        tokenizer=tokenizer,
        engine=SimpleNamespace(loaded=loaded, chat_end_ids={tokenizer.eos_token_id}),
    )


def test_prepare_chat_renders_a_store_without_template(plain_tokenizer):
    """prepare_chat (every chat endpoint): the encoder's prompt as ids, the parser starting in
    reasoning after thinking mode's <think>; reasoning_history keep keeps earlier reasoning;
    another family without a template is still a 400."""
    from moetier.engine.sampler import SamplingParams
    from moetier.server.parsers.serving import ParserChoice, prepare_chat

    engine = _engine(plain_tokenizer)
    choice = ParserChoice("deepseek_v4", "model_type")
    ids, _, parsing = prepare_chat(engine, choice, THINKING_TURNS, SamplingParams(), None, None,
                                   True, THINKING)  # fmt: skip
    history = (
        f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}</think>Hi there! How can I help you?{EOS}"
        f"{USER}What is the capital of France?{ASSISTANT}<think>"
    )
    assert ids == plain_tokenizer.encode(history, add_special_tokens=False)
    assert parsing.parser is not None and parsing.parser.state == "reasoning"
    keep = {**THINKING, "reasoning_history": "keep"}
    ids, _, _ = prepare_chat(engine, choice, THINKING_TURNS, SamplingParams(), None, None, True,
                             keep)  # fmt: skip
    assert "I should greet back.</think>" in plain_tokenizer.decode(ids)
    ids, _, parsing = prepare_chat(engine, choice, THINKING_TURNS, SamplingParams())
    assert plain_tokenizer.decode(ids).endswith(f"{ASSISTANT}</think>")
    assert parsing.parser is not None and parsing.parser.state == "content"
    with pytest.raises(ValueError, match="no chat template"):
        prepare_chat(_engine(plain_tokenizer, "qwen3_moe"), None, THINKING_TURNS, SamplingParams())


# -- through the real server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def dsv4_server(tiny, tmp_path_factory):
    """A tiny deepseek_v4 store with its chat template removed, served for real."""
    pytest.importorskip("transformers.models.deepseek_v4", reason="no DeepSeek-V4 in transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from uvicorn_thread import serving

    from moetier.config import EngineConfig
    from moetier.engine.async_engine import AsyncEngine
    from moetier.engine.engine import Engine
    from moetier.loader.load import load_model
    from moetier.server.app import create_app

    store = tmp_path_factory.mktemp("dsv4_plain") / "store"
    shutil.copytree(tiny.store("deepseek_v4"), store)
    (store / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((store / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (store / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_model(store, EngineConfig(device="cpu", dtype="float32", native=True))
    engine = AsyncEngine(Engine(loaded))
    assert not getattr(engine.tokenizer, "chat_template", None)
    with serving(create_app(engine, "tiny")) as url:
        yield url, engine.tokenizer


def test_chat_through_the_server_without_template(dsv4_server):
    import anthropic
    import httpx
    import openai

    url, tokenizer = dsv4_server
    [entry] = httpx.get(url + "/v1/models").json()["data"]
    assert entry["tool_parser"] == "deepseek_v4"
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello"}]
    counted = claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages)
    expected = f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}</think>"
    assert counted.input_tokens == len(tokenizer.encode(expected, add_special_tokens=False))

    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    body = {"ignore_eos": True, "chat_template_kwargs": THINKING}
    reply = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=body
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 6
    # thinking mode's prompt ends in <think>: the output begins as reasoning
    assert choice.message.model_extra.get("reasoning_content")
    reply = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].message.content  # chat mode: content
    assert not reply.choices[0].message.model_extra.get("reasoning_content")
    answer = claude.messages.create(
        model="tiny",
        max_tokens=4,
        messages=messages,
        extra_body={"temperature": 0},  # greedy (this client takes no temperature beside thinking)
        thinking={"type": "enabled", "budget_tokens": 64},
    )
    assert answer.content[0].type == "thinking"
