"""DeepSeek-V4 (Flash, Pro): DSML calls in a `tool_calls` block.

The format is defined by DeepSeek's own encoder, `encoding/encoding_dsv4.py` in the
deepseek-ai/DeepSeek-V4-Flash and DeepSeek-V4-Pro repositories (the model ships no Jinja
template): `encode_messages` ends the prompt in `<｜Assistant｜><think>` (thinking mode) or
`<｜Assistant｜></think>` (chat mode); an assistant turn is `REASONING</think>CONTENT`, then, when
it calls tools, `\\n\\n<｜DSML｜tool_calls>\\n` with one
`<｜DSML｜invoke name="NAME">\\n…\\n</｜DSML｜invoke>` per call, each holding
`<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>` lines
(`string="false"`: VALUE is JSON), then `\\n</｜DSML｜tool_calls>` and `<｜end▁of▁sentence｜>`.
`parse_message_from_completion_text` there reads the reasoning up to `</think>` and refuses a
`tool_calls` block before it, so calls are not taken inside reasoning. The block is V3.2's DSML
(deepseek_v32.py) under V4's block name.
"""

from __future__ import annotations

from moetier.server.parsers.deepseek_v32 import DSML
from moetier.server.parsers.invoke_xml import InvokeXmlParser


class DeepSeekV4Parser(InvokeXmlParser):
    family = "deepseek_v4"
    call_markers = (f"<{DSML}tool_calls>",)
    section_ends = (f"</{DSML}tool_calls>",)
    invoke_open = f'<{DSML}invoke name="'
    invoke_close = f"</{DSML}invoke>"
    param_open = f'<{DSML}parameter name="'
    param_close = f"</{DSML}parameter>"
    markers = ("<think>", "</think>", *call_markers, *section_ends)
