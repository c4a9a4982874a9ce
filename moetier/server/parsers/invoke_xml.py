"""The state machine of families whose calls are `invoke` elements holding `parameter` elements
(MiniMax-M2's `<minimax:tool_call>`, DeepSeek-V3.2's DSML): the family gives the markers."""

from __future__ import annotations

import re

from moetier.server.parsers.base import ThinkParser

_STRING_ATTR = re.compile(r'string="(true|false)"')


class InvokeXmlParser(ThinkParser):
    section_ends: tuple[str, ...] = ()
    invoke_open = '<invoke name="'
    invoke_close = "</invoke>"
    param_open = '<parameter name="'
    param_close = "</parameter>"

    def _tool_step(self, final: bool) -> bool:
        sub = self.sub
        if sub == "start":
            marker = self._skip_to((self.invoke_open,) + self.section_ends, final)
            if marker is None:
                return False
            if marker in self.section_ends:
                self.state = "content"
            else:
                self.sub = "name"
            return True
        if sub == "name":
            head = self._wait_for(">", final)
            if head is None:
                return False
            self._open_xml_call(head.split('"', 1)[0].strip())
            self.sub = "params"
            return True
        if sub == "params":
            marker = self._skip_to((self.param_open, self.invoke_close) + self.section_ends, final)
            if marker is None:
                return False
            if marker == self.param_open:
                self.sub = "key"
                return True
            self._close_call()
            if marker in self.section_ends:
                self.state = "content"
            else:
                self.sub = "start"
            return True
        if sub == "key":
            head = self._wait_for(">", final)
            if head is None:
                return False
            attr = _STRING_ATTR.search(head)
            raw = None if attr is None else attr.group(1) == "false"
            self._param_begin(head.split('"', 1)[0].strip(), raw)
            self.sub = "value"
            return True
        text, marker = self._scan((self.param_close, self.invoke_close), final)
        self._param_text(text)
        if marker is None:
            return False
        self._param_end()
        if marker == self.invoke_close:
            self._close_call()
            self.sub = "start"
        else:
            self.sub = "params"
        return True
