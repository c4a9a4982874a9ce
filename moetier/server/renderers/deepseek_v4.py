"""DeepSeek-V4's prompt, as DeepSeek's own encoder writes it.

DeepSeek-V4 (Flash, Pro) ships no Jinja chat template: its prompt format is defined by
`encode_messages` in `encoding/encoding_dsv4.py` of the deepseek-ai/DeepSeek-V4-Flash and
DeepSeek-V4-Pro repositories. `render` produces the same string from the server's chat messages
(system, user, assistant with `reasoning_content` and OpenAI `tool_calls`, tool results), the
request's tools and the thinking switch:

- `<｜begin▁of▁sentence｜>` first; a system message is its bare text, the tools section
  (`## Tools`, the DSML call syntax, one JSON schema a line) after a blank line; tools go on the
  first system message, or on an empty one put first when the conversation has none.
- A user turn is `<｜User｜>TEXT`; tool results become `<tool_result>…</tool_result>` blocks of a
  user turn, in the order of the calls that asked for them, joined with adjacent user text by a
  blank line (the encoder has no tool role).
- A user turn that the next assistant turn (or the end) follows gets `<｜Assistant｜>` and then
  `<think>` in thinking mode (`</think>` in chat mode, and for earlier turns whose reasoning is
  dropped); an assistant turn is `REASONING</think>CONTENT`, then the calls as
  `\\n\\n<｜DSML｜tool_calls>\\n` … `\\n</｜DSML｜tool_calls>`, then `<｜end▁of▁sentence｜>`
  (left off when the turn is continued).
- Reasoning of turns before the last user turn is dropped in thinking mode unless tools are
  given (the encoder then keeps every turn's) or `drop_thinking` is false
  (`reasoning_history: keep`).

Template variables read: `thinking` / `enable_thinking` (either true: thinking mode; default
chat mode, as vLLM's DeepSeek tokenizers), `reasoning_effort` (`max` puts DeepSeek's
maximum-effort instruction first in thinking mode; `high` or none: nothing) and `drop_thinking`.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
CALLS_BLOCK = "tool_calls"

TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f'by writing a "<{DSML}{CALLS_BLOCK}>" block like the following:\n\n'
    f"<{DSML}{CALLS_BLOCK}>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}{CALLS_BLOCK}>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
)

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
EFFORTS = ("high", "max")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The tools part of the system prompt: each function's schema as one line of JSON."""
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return TOOLS_SECTION.replace("{schemas}", schemas)


def _arguments(arguments: Any) -> dict[str, Any]:
    """A call's arguments as a mapping: given as one, or a JSON object string; anything else
    is kept whole under `arguments` (as the encoder does with a string it cannot load)."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    try:
        loaded = json.loads(arguments)
    except (TypeError, ValueError):
        loaded = None
    return loaded if isinstance(loaded, dict) else {"arguments": arguments}


def dsml_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls as the DSML block the model writes (blank line first)."""
    invokes = []
    for call in calls:
        function = call.get("function") or call
        params = [
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for key, v in _arguments(function.get("arguments")).items()
        ]
        body = "\n".join(params)
        invokes.append(f'<{DSML}invoke name="{function.get("name")}">\n{body}\n</{DSML}invoke>')
    return f"\n\n<{DSML}{CALLS_BLOCK}>\n" + "\n".join(invokes) + f"\n</{DSML}{CALLS_BLOCK}>"


def _merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages as `tool_result` blocks of user turns; a user message joins the user turn
    before it (the encoder's merge: a turn holds text and result blocks in order)."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = {
                "type": "tool_result",
                "id": message.get("tool_call_id") or "",
                "text": _text(message.get("content")),
            }
        elif role == "user":
            block = {"type": "text", "text": _text(message.get("content"))}
        else:
            merged.append(dict(message))
            continue
        if merged and merged[-1].get("role") == "user":
            merged[-1]["blocks"].append(block)
        else:
            merged.append({"role": "user", "blocks": [block]})
    return merged


def _order_results(messages: list[dict[str, Any]]) -> None:
    """Each user turn's tool results in the order of the last assistant turn's calls (by id;
    an unknown id counts as the first call), other blocks where they are."""
    order: dict[str, int] = {}
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            order = {}
            for i, call in enumerate(message["tool_calls"]):
                if call.get("id"):
                    order[call["id"]] = i
        elif message.get("role") == "user" and order:
            results = [b for b in message["blocks"] if b["type"] == "tool_result"]
            if len(results) < 2:
                continue
            ordered = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
            message["blocks"] = [
                next(ordered) if b["type"] == "tool_result" else b for b in message["blocks"]
            ]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts
        return "\n\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _user_text(message: dict[str, Any]) -> str:
    parts = [
        f"<tool_result>{b['text']}</tool_result>" if b["type"] == "tool_result" else b["text"]
        for b in message["blocks"]
    ]
    return "\n\n".join(parts)


def thinking_mode(template_kwargs: dict[str, Any]) -> bool:
    """Thinking mode when `thinking` or `enable_thinking` is true; chat mode otherwise."""
    return bool(template_kwargs.get("thinking")) or bool(template_kwargs.get("enable_thinking"))


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
) -> str:
    """The prompt DeepSeek's `encode_messages` writes for these chat messages (roles system,
    user, assistant, tool; developer as system) and tools; `continue_final`: the last assistant
    turn is left open (no end of sentence) for the model to continue. ValueError for a
    `reasoning_effort` the encoder does not know."""
    kwargs = template_kwargs or {}
    thinking = thinking_mode(kwargs)
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise ValueError(
            f"chat_template_kwargs.reasoning_effort {effort!r}: DeepSeek-V4 takes "
            + " or ".join(EFFORTS)
        )
    drop = bool(kwargs.get("drop_thinking", True)) and not tools

    turns = [{**m, "role": "system"} if m.get("role") == "developer" else dict(m) for m in messages]
    if tools:
        if turns and turns[0].get("role") == "system":
            turns[0]["tools"] = tools
        else:
            turns.insert(0, {"role": "system", "content": "", "tools": tools})
    turns = _merge_tool_results(turns)
    _order_results(turns)
    for message in turns:
        if message.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"DeepSeek-V4 has no {message.get('role')!r} role")
    if continue_final and turns and turns[-1].get("role") == "assistant":
        turns[-1]["open"] = True

    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    prompt = BOS
    if thinking and effort == "max" and turns:
        prompt += EFFORT_MAX
    for i, message in enumerate(turns):
        role = message["role"]
        if role == "system":
            prompt += _text(message.get("content"))
            if message.get("tools"):
                prompt += "\n\n" + tools_section(message["tools"])
        elif role == "user":
            prompt += USER + _user_text(message)
        else:
            reasoning = ""
            # thinking mode writes the reasoning (possibly empty) and its end, except for
            # earlier turns whose reasoning is dropped
            if thinking and (not drop or i > last_user):
                reasoning = _text(message.get("reasoning_content")) + THINK_END
            calls = dsml_calls(message["tool_calls"]) if message.get("tool_calls") else ""
            prompt += reasoning + _text(message.get("content")) + calls
            if not message.get("open"):
                prompt += EOS
        follows = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if role == "user" and follows in (None, "assistant"):
            prompt += ASSISTANT
            opens = thinking and (not drop or i >= last_user)
            prompt += THINK_START if opens else THINK_END
    return prompt
