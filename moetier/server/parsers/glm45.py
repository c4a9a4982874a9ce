"""GLM-4.5/4.6 (`glm45`) and GLM-4.7/5.x (`glm47`): `<think>…</think>` (GLM-4.7's template opens
`<think>` itself; disabled thinking renders `</think>`), calls as
`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`, GLM-4.5 with a
newline after the name and each pair. `<tool_call>NAME</tool_call>` is a call without arguments.
Values carry no types: the tool schema gives them (xml_args.py)."""

from __future__ import annotations

from moetier.server.parsers.base import ThinkParser

_NAME_ENDS = ("\n", "<arg_key>", "</tool_call>")


class Glm45Parser(ThinkParser):
    family = "glm45"
    call_markers = ("<tool_call>",)
    markers = (
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
    )

    def _tool_step(self, final: bool) -> bool:
        sub = self.sub
        if sub == "start":
            ends = [(self.buf.find(m), m) for m in _NAME_ENDS if m in self.buf]
            if not ends:
                return False
            at, end = min(ends)
            name = self.buf[:at].strip()
            if not name and end == "\n":
                self.buf = self.buf[1:]  # a newline before the name
                return True
            self.buf = self.buf[at + len(end) :]
            self._open_xml_call(name)
            if end == "</tool_call>":
                self._end_call()
            else:
                self.sub = "key" if end == "<arg_key>" else "args"
            return True
        if sub == "args":
            marker = self._skip_to(("<arg_key>", "</tool_call>"), final)
            if marker is None:
                return False
            if marker == "</tool_call>":
                self._end_call()
            else:
                self.sub = "key"
            return True
        if sub == "key":
            key = self._wait_for("</arg_key>", final)
            if key is None:
                return False
            self._key = key.strip()
            self.sub = "value_start"
            return True
        if sub == "value_start":
            marker = self._skip_to(("<arg_value>",), final)
            if marker is None:
                return False
            self._param_begin(self._key)
            self.sub = "value"
            return True
        text, marker = self._scan(("</arg_value>",), final)
        self._param_text(text)
        if marker is None:
            return False
        self._param_end()
        self.sub = "args"
        return True

    def _end_call(self) -> None:
        self._close_call()
        self.state = "content"


class Glm47Parser(Glm45Parser):
    family = "glm47"
