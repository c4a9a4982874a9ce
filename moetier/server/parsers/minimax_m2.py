"""MiniMax-M2: `<think>…</think>` (the template pre-fills `<think>\\n`; the reasoning must be kept
in history: interleaved thinking), then
`<minimax:tool_call>\\n<invoke name="NAME"><parameter name="KEY">VALUE</parameter>…</invoke>\\n
</minimax:tool_call>`. Values are typed by the tool schema (xml_args.py)."""

from __future__ import annotations

from moetier.server.parsers.invoke_xml import InvokeXmlParser


class MiniMaxM2Parser(InvokeXmlParser):
    family = "minimax_m2"
    call_markers = ("<minimax:tool_call>",)
    section_ends = ("</minimax:tool_call>",)
    markers = ("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>")
