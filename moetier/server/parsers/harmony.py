"""gpt-oss (OpenAI harmony): the answer is a series of messages, each a header and a body:
`<|channel|>analysis<|message|>…<|end|>` (reasoning),
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>`
(a tool call; the recipient may also stand before `<|channel|>`), and
`<|start|>assistant<|channel|>final<|message|>…<|return|>` (the answer). Commentary without a
recipient is a preamble to the user: content. The prompt ends in `<|start|>assistant`, so the
output begins inside a header. The markers are special tokens: the detokenizer keeps them.
"""

from __future__ import annotations

import re

from moetier.server.parsers.base import Parser

_MESSAGE = "<|message|>"
_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser(Parser):
    family = "harmony"
    markers = ("<|channel|>", "<|message|>", "<|constrain|>", "<|start|>", "<|end|>")

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs["starts_in_reasoning"] = False
        super().__init__(*args, **kwargs)
        self.state = "header"

    @classmethod
    def prompt_ends_in_reasoning(cls, prompt: str) -> bool:
        return False

    def _step(self, final: bool) -> bool:
        if self.state == "header":
            at = self.buf.find(_MESSAGE)
            if at == -1:
                return False
            header, self.buf = self.buf[:at], self.buf[at + len(_MESSAGE) :]
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            if recipient and recipient.group(1) != "all" and self.calls_enabled:
                self.raw = header + _MESSAGE
                self._open_json_call(recipient.group(1).removeprefix("functions."))
                self.state = "call"
            elif channel and channel.group(1) == "analysis":
                self.state = "reasoning"
            else:
                self.state = "content"
            return True
        text, marker = self._scan(_BODY_ENDS, final)
        if self.state == "reasoning":
            self._emit_reasoning(text)
        elif self.state == "content":
            self._emit_content(text)
        else:
            self._json_args(text)
        if marker is None:
            return False
        if self.state == "call":
            self._close_call()
        self._end_segment()
        self.state = "header"
        return True

    def _finish(self) -> None:
        if self.state == "header" and self.buf.strip() and _MESSAGE not in self.buf:
            header = self.buf.replace("<|start|>", "").strip()
            if header and header != "assistant" and "<|" not in header:
                # no harmony markup at all (a model without its special tokens): plain text
                self._warn("output without harmony markup passed on as content")
                self._emit_content(self.buf)
                self.buf = ""
            else:
                self.buf = ""
        super()._finish()
