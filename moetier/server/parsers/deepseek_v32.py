"""DeepSeek-V3.2 (DSML): `<think>…</think>`, then
`<｜DSML｜function_calls>` (some builds: `tool_calls`) wrapping
`<｜DSML｜invoke name="NAME">` elements of
`<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`:
`string="false"` marks VALUE as raw JSON (numbers, booleans, arrays, objects)."""

from __future__ import annotations

from moetier.server.parsers.invoke_xml import InvokeXmlParser

DSML = "｜DSML｜"


class DeepSeekV32Parser(InvokeXmlParser):
    family = "deepseek_v32"
    call_markers = (f"<{DSML}function_calls>", f"<{DSML}tool_calls>")
    section_ends = (f"</{DSML}function_calls>", f"</{DSML}tool_calls>")
    invoke_open = f'<{DSML}invoke name="'
    invoke_close = f"</{DSML}invoke>"
    param_open = f'<{DSML}parameter name="'
    param_close = f"</{DSML}parameter>"
    markers = ("<think>", "</think>", *call_markers, *section_ends)
