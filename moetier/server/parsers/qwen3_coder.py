"""Qwen3-Coder and Qwen3.5/3.6: `<think>…</think>`, then calls as
`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n…</function>\\n</tool_call>`.

Values carry no types: the request's tool schema gives them (xml_args.py); a string parameter
streams while it is generated (long file contents included). The newline after `<parameter=KEY>`
and the one before `</parameter>` belong to the format, not the value. A missing `</parameter>`
(the next `<parameter=` or `</function>` comes first) ends the value too.
"""

from __future__ import annotations

from moetier.server.parsers.base import ThinkParser

_VALUE_ENDS = (
    "\n</parameter>",
    "</parameter>",
    "\n<parameter=",
    "<parameter=",
    "\n</function>",
    "</function>",
    "</tool_call>",
)


class Qwen3CoderParser(ThinkParser):
    family = "qwen3_coder"
    calls_in_reasoning = True
    call_markers = ("<tool_call>",)
    markers = ("<think>", "</think>", "<tool_call>", "</tool_call>")

    def _tool_step(self, final: bool) -> bool:  # noqa: C901 (one state machine)
        sub = self.sub
        if sub == "start":
            marker = self._skip_to(("<function=", "</tool_call>"), final)
            if marker is None:
                return False
            if marker == "</tool_call>":
                self._warn("an empty <tool_call> was dropped")
                self.state = "content"
            else:
                self.sub = "name"
            return True
        if sub == "name":
            name = self._wait_for(">", final)
            if name is None:
                return False
            self._open_xml_call(name.strip())
            self.sub = "params"
            return True
        if sub == "params":
            marker = self._skip_to(("<parameter=", "</function>", "</tool_call>"), final)
            if marker is None:
                return False
            if marker == "<parameter=":
                self.sub = "key"
            elif marker == "</function>":
                self.sub = "end"
            else:
                self._end_call()
            return True
        if sub == "key":
            key = self._wait_for(">", final)
            if key is None:
                return False
            self._param_begin(key.strip())
            self.sub = "lead"
            return True
        if sub == "lead":  # the format's newline before the value
            if not self.buf:
                return False
            if self.buf.startswith("\n"):
                self.buf = self.buf[1:]
            self.sub = "value"
            return True
        if sub == "value":
            text, marker = self._scan(_VALUE_ENDS, final)
            self._param_text(text)
            if marker is None:
                return False
            self._param_end()
            if marker.endswith("<parameter="):
                self.sub = "key"
            elif marker.endswith("</function>"):
                self.sub = "end"
            elif marker == "</tool_call>":
                self._end_call()
            else:
                self.sub = "params"
            return True
        # after </function>
        marker = self._skip_to(("</tool_call>",), final)
        if marker is None:
            return False
        self._end_call()
        return True

    def _end_call(self) -> None:
        self._close_call()
        self.state = "content"
