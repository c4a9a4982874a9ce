"""`moetier parse --family NAME [--tools FILE] [--prompt-ends-in-reasoning] [--stream]`: raw model
output on stdin -> the assistant message the server would return (content, reasoning_content,
tool_calls) as JSON, or with --stream the deltas as they come, one JSON line each. For debugging
reasoning and tool-call parsing."""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from pathlib import Path
from typing import Any

from moetier.server.parsers import ALIASES, FAMILIES, Message, make_parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family",
        required=True,
        help=f"parser family: {', '.join(sorted(FAMILIES))} (or an alias: "
        f"{', '.join(sorted(ALIASES))})",
    )
    parser.add_argument(
        "--tools",
        type=Path,
        help="JSON file with the request's tools (a list, or an object with a 'tools' list): "
        "their schemas type XML-style argument values",
    )
    parser.add_argument(
        "--prompt-ends-in-reasoning",
        action="store_true",
        help="the rendered prompt left the model inside its reasoning block (a template that "
        "opens <think> itself)",
    )
    parser.add_argument(
        "--no-parallel-tool-calls",
        action="store_true",
        help="keep only the first tool call (the request's parallel_tool_calls: false)",
    )
    parser.add_argument(
        "--call-offset",
        type=int,
        default=0,
        help="tool calls earlier in the conversation (Kimi numbers its call ids over it)",
    )
    parser.add_argument(
        "--stream", action="store_true", help="print each delta as a JSON line as stdin arrives"
    )


def _tools(path: Path | None) -> list[dict[str, Any]] | None:
    if path is None:
        return None
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("tools")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of tools or an object with 'tools'")
    return data


def run(args: argparse.Namespace) -> int:
    parser = make_parser(
        args.family,
        tools=_tools(args.tools),
        starts_in_reasoning=args.prompt_ends_in_reasoning,
        parallel_tool_calls=not args.no_parallel_tool_calls,
        call_offset=args.call_offset,
    )
    message = Message()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stdin: Any = sys.stdin.buffer  # a BufferedReader: read1 returns what has arrived
    while True:
        chunk = stdin.read1(4096) if args.stream else stdin.read()
        text = decoder.decode(chunk, final=not chunk)
        delta = parser.feed(text) if text else None
        if not chunk:
            tail = parser.finish()
            if delta is None:
                delta = tail
            else:
                delta.extend(tail)
        if delta:
            message.apply(delta)
            if args.stream:
                print(json.dumps(delta.openai(), ensure_ascii=False), flush=True)
        if not chunk:
            break
    for warning in parser.warnings:
        print(f"moetier parse: warning: {warning}", file=sys.stderr)
    if not args.stream:
        out = {
            "content": message.content,
            "reasoning_content": message.reasoning_content,
            "tool_calls": message.tool_calls,
        }
        print(json.dumps(out, ensure_ascii=False, indent=2))
    return 0
