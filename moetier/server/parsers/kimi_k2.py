"""Kimi-K2 and K2-Thinking: `<think>…</think>`, then
`<|tool_calls_section_begin|>` and per call
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}<|tool_call_end|>`, then
`<|tool_calls_section_end|>` (the singular `<|tool_call_section_begin|>` also occurs).

Kimi opens calls before closing its reasoning. Ids are `functions.NAME:IDX`, IDX counting the
calls of the whole conversation (`call_offset`): the model's own id is kept when it has this
form and is not a repeat, else one is made (an OpenAI-style id in history sends Kimi astray).
"""

from __future__ import annotations

import re

from moetier.server.parsers.base import ThinkParser

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_KIMI_ID = re.compile(r"functions\.(.+):(\d+)")


class KimiK2Parser(ThinkParser):
    family = "kimi_k2"
    calls_in_reasoning = True
    call_markers = SECTION_BEGIN + (CALL_BEGIN,)
    markers = (
        "<think>",
        "</think>",
        *SECTION_BEGIN,
        *SECTION_END,
        CALL_BEGIN,
        ARGS_BEGIN,
        CALL_END,
    )

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._ids: set[str] = set()  # ids given out: a repeated one is replaced

    def _enter_tool(self, marker: str) -> None:
        self.sub = "head" if marker == CALL_BEGIN else "start"

    def _tool_step(self, final: bool) -> bool:
        if self.sub == "start":
            marker = self._skip_to((CALL_BEGIN,) + SECTION_END, final)
            if marker is None:
                return False
            if marker in SECTION_END:
                self.state = "content"
            else:
                self.sub = "head"
            return True
        if self.sub == "head":
            head = self._wait_for(ARGS_BEGIN, final)
            if head is None:
                return False
            raw = head.strip()
            match = _KIMI_ID.fullmatch(raw)
            if match and raw not in self._ids:
                name, call_id = match.group(1), raw
            else:
                name = raw.removeprefix("functions.").rsplit(":", 1)[0]
                call_id = f"functions.{name}:{self.call_offset + self.calls}"
            self._ids.add(call_id)
            self._open_json_call(name, call_id)
            self.sub = "args"
            return True
        text, marker = self._scan((CALL_END,) + SECTION_END, final)
        self._json_args(text)
        if marker is None:
            return False
        self._close_call()
        if marker in SECTION_END:
            self.state = "content"
        else:
            self.sub = "start"
        return True
