"""Hermes / Qwen2.5 / Qwen3: `<think>…</think>`, then calls as
`<tool_call>\\n{"name": NAME, "arguments": {…}}\\n</tool_call>`, one block per call.

Qwen3 models sometimes open `<tool_call>` before `</think>`: the call ends the reasoning.
The arguments stream once `"arguments": {` has been read; a call written some other way (keys in
another order, no arguments, arguments as a JSON string) is read whole at its `</tool_call>`.
"""

from __future__ import annotations

import json
import re

from moetier.server.parsers.base import ThinkParser
from moetier.server.parsers.xml_args import dumps

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _name(quoted: str) -> str:
    """A JSON string's contents as text (raw control characters allowed)."""
    try:
        return str(json.loads(f'"{quoted}"', strict=False))
    except ValueError:
        return quoted


class HermesParser(ThinkParser):
    family = "hermes"
    calls_in_reasoning = True
    call_markers = (_OPEN,)
    markers = ("<think>", "</think>", _OPEN, _CLOSE)

    def _tool_step(self, final: bool) -> bool:
        if self.sub == "start":
            end = self.buf.find(_CLOSE)
            head = _HEAD.match(self.buf)
            if head and (end == -1 or head.end() < end):
                after = self.buf[head.end() : head.end() + 1]
                if not after and not final:
                    return False  # what the arguments are is not known yet
                if after == "{":  # an object: streamed as it comes
                    self.buf = self.buf[head.end() :]
                    self._open_json_call(_name(head.group(1)))
                    self.sub = "args"
                    return True
                # anything else (arguments as a JSON string): read whole at </tool_call>
            body = self._wait_for(_CLOSE, final)
            if body is None:
                return False
            self._whole(body)
            self.state = "content"
            return True
        text, marker = self._scan((_CLOSE,), final)
        self._json_args(text)
        if marker is None:
            return False
        self._close_call(trailer="}")
        self.state = "content"
        return True

    def _whole(self, body: str) -> None:
        """A call read at its end: `{"name": …}` with `arguments` (or `parameters`) an object,
        a JSON string of one, or absent."""
        try:
            call = json.loads(body, strict=False)
        except ValueError:
            call = None
        args = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(args, dict)
        ):
            self._warn(f"a <tool_call> that is not a JSON call was passed on as content: {body!r}")
            self._emit_content(_OPEN + body + _CLOSE)
            self._end_segment()
            return
        self._open_call(call["name"])
        self._call_args(dumps(args))
        self._close_call()
