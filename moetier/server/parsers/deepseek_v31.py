"""DeepSeek-V3.1: hybrid thinking (the `thinking` template kwarg: the prompt ends in `<think>` or
`</think>`), calls as `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>` inside
`<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>` (no `function` word, no code fence)."""

from __future__ import annotations

from moetier.server.parsers.deepseek_v3 import SEP, DeepSeekV3Parser


class DeepSeekV31Parser(DeepSeekV3Parser):
    family = "deepseek_v31"

    def _head(self, final: bool) -> bool:
        at = self.buf.find(SEP)
        if at == -1:
            return False
        name = self.buf[:at].strip()
        self.buf = self.buf[at + len(SEP) :]
        self._open_json_call(name)
        self.sub = "args"
        return True
