"""A message's text parts (OpenAI content parts, Anthropic text blocks and `system` blocks,
Responses input_text parts) reach the chat template joined by a newline, as vLLM joins them:
rendered through a real chat template (/work/shared/chat-templates), Claude Code's several
system and user blocks keep their words apart."""

from __future__ import annotations

import pytest
from conftest import SHARED
from transformers.utils.chat_template_utils import render_jinja_template

from moetier.server import anthropic, responses
from moetier.server.openai import ChatMessage

TEMPLATE = SHARED / "chat-templates" / "qwen3.jinja"  # a real template (CI has the folder)

REMINDER = "<system-reminder>Be careful.</system-reminder>"
ASK = "list files"
SYSTEM = ["You are Claude Code.", "Answer briefly."]


def parts(kind: str, *texts: str) -> list[dict]:
    return [{"type": kind, "text": t} for t in texts]


def render(messages: list[dict]) -> str:
    if not TEMPLATE.is_file():  # a failure, not a skip: these tests must not pass unrun
        pytest.fail(f"{TEMPLATE} not found: the shared chat templates are needed")
    rendered, _ = render_jinja_template(
        [messages], chat_template=TEMPLATE.read_text(), add_generation_prompt=True
    )
    return rendered[0]


def joined() -> str:
    """What each API's messages must render to: every message's parts joined by a newline."""
    return render(
        [
            {"role": "system", "content": "\n".join(SYSTEM)},
            {"role": "user", "content": f"{REMINDER}\n{ASK}"},
        ]
    )


def test_the_expected_prompt_keeps_the_words_apart():
    prompt = joined()
    assert f"</system-reminder>\n{ASK}" in prompt and "Claude Code.\nAnswer" in prompt


def test_openai_content_parts_are_joined_by_a_newline():
    messages = [
        {"role": "system", "content": parts("text", *SYSTEM)},
        {"role": "user", "content": parts("text", REMINDER, ASK)},
    ]
    rendered = render([ChatMessage.model_validate(m).template_message() for m in messages])
    assert rendered == joined()


def test_anthropic_system_and_message_blocks_are_joined_by_a_newline():
    system = [anthropic.Block(type="text", text=t) for t in SYSTEM]
    user = anthropic.Message.model_validate(
        {"role": "user", "content": parts("text", REMINDER, ASK)}
    )
    assert render(anthropic.chat_messages(system, [user])) == joined()


def test_anthropic_billing_block_leaves_no_empty_line():
    """Claude Code's billing line as a block of its own is dropped whole, not as an empty
    line at the start of the system prompt."""
    billing = "x-anthropic-billing-header: cc_version=2.1.77.a1b; cc_entrypoint=cli; cch=0a1b2;"
    system = [anthropic.Block(type="text", text=t) for t in (billing, *SYSTEM)]
    user = anthropic.Message(role="user", content=f"{REMINDER}\n{ASK}")
    assert render(anthropic.chat_messages(system, [user])) == joined()


def test_anthropic_tool_result_blocks_are_joined_by_a_newline():
    user = anthropic.Message.model_validate(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": parts("text", "a.py", "b.py"),
                }
            ],
        }
    )
    (tool,) = anthropic.chat_messages(None, [user])
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"}


def test_responses_input_text_parts_are_joined_by_a_newline():
    items = [
        responses.InputItem.model_validate(
            {"role": "system", "content": parts("input_text", *SYSTEM)}
        ),
        responses.InputItem.model_validate(
            {"role": "user", "content": parts("input_text", REMINDER, ASK)}
        ),
    ]
    assert render(responses.chat_messages(None, items)) == joined()
