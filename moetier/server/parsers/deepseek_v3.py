"""DeepSeek-V3 (0324) and R1-0528: `<think>…</think>` (the template pre-fills `<think>\\n`), then
`<｜tool▁calls▁begin｜>` and per call
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{…}\\n```<｜tool▁call▁end｜>`,
then `<｜tool▁calls▁end｜>`. The markers are special tokens: the detokenizer keeps them for us.
"""

from __future__ import annotations

from moetier.server.parsers.base import ThinkParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV3Parser(ThinkParser):
    family = "deepseek_v3"
    call_markers = (CALLS_BEGIN, CALL_BEGIN)
    markers = ("<think>", "</think>", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def _enter_tool(self, marker: str) -> None:
        self.sub = "head" if marker == CALL_BEGIN else "section"

    def _tool_step(self, final: bool) -> bool:
        if self.sub == "section":
            marker = self._skip_to((CALL_BEGIN, CALLS_END), final)
            if marker is None:
                return False
            if marker == CALLS_END:
                self.state = "content"
            else:
                self.sub = "head"
            return True
        if self.sub == "head":
            return self._head(final)
        if self.sub == "fence":
            stripped = self.buf.lstrip()
            if "```".startswith(stripped[:3]) and "\n" not in stripped and not final:
                return False  # the code fence's first line is not complete yet
            if stripped.startswith("```"):
                stripped = stripped.split("\n", 1)[1] if "\n" in stripped else ""
            self.buf = stripped
            self.sub = "args"
            return True
        text, marker = self._scan((CALL_END, CALLS_END), final)
        self._json_args(text)
        if marker is None:
            return False
        self._close_call(trailer="`")
        self.sub = "section"
        if marker == CALLS_END:
            self.state = "content"
        return True

    def _head(self, final: bool) -> bool:
        """`function<｜tool▁sep｜>NAME\\n`, then a code fence."""
        at = self.buf.find(SEP)
        if at == -1:
            return False
        line_end = self.buf.find("\n", at)
        if line_end == -1:
            return False
        name = self.buf[at + len(SEP) : line_end].strip()
        self.buf = self.buf[line_end + 1 :]
        self._open_json_call(name)
        self.sub = "fence"
        return True
