"""Mistral: `[THINK]…[/THINK]` (Magistral), then calls in one of two forms:
newer tokenizers `[TOOL_CALLS]NAME[ARGS]{…}` (also `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{…}`), one
`[TOOL_CALLS]` per call; older ones `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]`, a JSON list
read whole at the end of the output. Ids are 9 alphanumerics (Mistral's templates refuse others).
"""

from __future__ import annotations

import json
import random
import string

from moetier.server.parsers.base import ThinkParser
from moetier.server.parsers.xml_args import dumps

TOOL_CALLS = "[TOOL_CALLS]"
_TAGS = ("[ARGS]", "[CALL_ID]")


def mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class MistralParser(ThinkParser):
    family = "mistral"
    think_start = "[THINK]"
    think_end = "[/THINK]"
    call_markers = (TOOL_CALLS,)
    markers = ("[THINK]", "[/THINK]", TOOL_CALLS, "[ARGS]", "[CALL_ID]")

    def default_id(self) -> str:
        return mistral_id()

    def _tool_step(self, final: bool) -> bool:
        sub = self.sub
        if sub == "start":
            stripped = self.buf.lstrip()
            if not stripped or (
                not final and any(m.startswith(stripped) and m != stripped for m in _TAGS)
            ):
                return False  # nothing yet, or what may still become a tag
            if stripped[0] in "[{" and not stripped.startswith(_TAGS):
                self.sub = "list"
                return True
            ends = [(self.buf.find(m), m) for m in ("[ARGS]", "[CALL_ID]") if m in self.buf]
            if not ends:
                return False
            at, end = min(ends)
            self._name = self.buf[:at].strip()
            self.buf = self.buf[at + len(end) :]
            self.sub = "args" if end == "[ARGS]" else "id"
            if end == "[ARGS]":
                self._open_json_call(self._name)
            return True
        if sub == "id":
            call_id = self._wait_for("[ARGS]", final)
            if call_id is None:
                return False
            self._open_json_call(self._name, call_id.strip() or None)
            self.sub = "args"
            return True
        if sub == "args":
            text, marker = self._scan((TOOL_CALLS,), final)
            self._json_args(text)
            if marker is None:
                return False
            self._close_call(carry=marker)
            self.sub = "start"
            return True
        # the older form: a JSON list, read whole
        if not final:
            return False
        text, self.buf = self.buf, ""
        self._list(text)
        self.state = "content"
        return False

    def _list(self, text: str) -> None:
        try:
            calls, _ = json.JSONDecoder().raw_decode(text.strip())
        except ValueError:
            calls = None
        if isinstance(calls, dict):
            calls = [calls]
        good = isinstance(calls, list) and all(
            isinstance(c, dict)
            and isinstance(c.get("name"), str)
            and isinstance(c.get("arguments", {}), dict)
            for c in calls
        )
        if not good:
            self._warn("[TOOL_CALLS] not followed by a JSON list of calls, passed on as content")
            self._emit_content(TOOL_CALLS + text)
            return
        for call in calls:
            call_id = call.get("id")
            self._open_call(call["name"], call_id if isinstance(call_id, str) else None)
            self._call_args(dumps(call.get("arguments", {})))
            self._close_call()
