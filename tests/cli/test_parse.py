"""`moetier parse` as users run it (a subprocess reading stdin): the message as JSON equals the
parser's own; --tools types XML-style values; --stream prints deltas while stdin is still open,
and they add up to the same message; warnings go to stderr; an unknown family is a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from parser_cases import CASES, TOOLS

from moetier.server.parsers import make_parser  # noqa: E402


def _run(args: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moetier", "parse", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        encoding="utf-8",
    )


def _without_ids(calls: list[dict]) -> list[dict]:
    return [{**c, "id": None} for c in calls]


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": TOOLS}))
    return path


@pytest.mark.parametrize("family", ["qwen3_coder", "harmony", "kimi_k2", "deepseek_v4"])
def test_message_matches_the_parser(family, tools_file):
    case = next(c for c in CASES if c.family == family and c.calls)
    flags = ["--family", family, "--tools", str(tools_file)]
    if case.starts_in_reasoning:
        flags.append("--prompt-ends-in-reasoning")
    if case.call_offset:
        flags += ["--call-offset", str(case.call_offset)]
    done = _run(flags, case.raw)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    want = make_parser(
        family,
        tools=TOOLS,
        starts_in_reasoning=case.starts_in_reasoning,
        call_offset=case.call_offset,
    ).parse(case.raw)
    assert out["content"] == want.content
    assert out["reasoning_content"] == want.reasoning_content
    assert _without_ids(out["tool_calls"]) == _without_ids(want.tool_calls)
    if family == "kimi_k2":
        assert [c["id"] for c in out["tool_calls"]] == case.ids


def test_tools_file_types_values(tools_file):
    raw = "<tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    typed = json.loads(_run(["--family", "glm47", "--tools", str(tools_file)], raw).stdout)
    untyped = json.loads(_run(["--family", "glm47"], raw).stdout)
    assert json.loads(typed["tool_calls"][0]["function"]["arguments"]) == {"days": 3}
    assert json.loads(untyped["tool_calls"][0]["function"]["arguments"]) == {"days": "3"}


def test_stream_prints_deltas_as_stdin_arrives(tools_file):
    case = next(c for c in CASES if c.id == "qwen3_coder-long-string-value-and-parallel")
    head, tail = case.raw[:120], case.raw[120:]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moetier",
            "parse",
            "--family",
            "qwen3_coder",
            "--stream",
            "--tools",
            str(tools_file),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(head.encode())
    proc.stdin.flush()
    first = json.loads(proc.stdout.readline())  # arrives before stdin is closed
    assert first["tool_calls"][0]["function"]["name"] == "write_file"
    proc.stdin.write(tail.encode())
    proc.stdin.close()
    lines = [first] + [json.loads(line) for line in proc.stdout.read().splitlines()]
    assert proc.wait(timeout=60) == 0
    calls: list[dict] = []
    for delta in lines:
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                calls.append({"name": piece["function"]["name"], "arguments": ""})
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    got = [(c["name"], json.loads(c["arguments"])) for c in calls]
    assert got == case.calls


def test_warnings_go_to_stderr():
    raw = '<tool_call>\n{"name": "f", "arguments": {"a": '
    done = _run(["--family", "hermes"], raw)
    assert done.returncode == 0
    out = json.loads(done.stdout)
    assert out["tool_calls"] == [] and out["content"] == raw.rstrip()  # content, not a call
    assert "warning" in done.stderr and "passed on as content" in done.stderr


def test_unknown_family_is_an_error():
    done = _run(["--family", "nope"], "x")
    assert done.returncode == 1
    assert "unknown parser family 'nope'" in done.stderr and "hermes" in done.stderr
