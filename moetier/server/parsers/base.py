"""What every family parser shares: the delta and message types, and the streaming machinery.

A parser turns a model's raw output text, fed in pieces as it is decoded, into ordered parts:
reasoning text, content text and tool-call deltas in OpenAI's streaming shape (the first delta of a
call carries its index, id and name, later ones argument fragments as they are generated). Feeding
the whole text at once and feeding it in any split gives the same accumulated `Message`: every
decision waits until the text that settles it has arrived (a tail that could still grow into a
marker is held back).

Tool calls whose arguments are not valid JSON are never passed on as calls: a call is announced
(its first delta) only once its name and first argument bytes are known good (for JSON
arguments: `{"` or `{}`); arguments that end where only closing brackets are missing are
repaired, with a warning; any other broken call is returned as content (its markup as the model
wrote it), with a warning. When that is found after the call was announced and fragments were
streamed, a `withdrawn` part says so: the accumulated `Message` (the non-streamed answer) drops
the call and has its markup as content; a stream cannot take back what it sent, so it sends the
markup as content and no closing fragment (the call's arguments stay unparseable JSON).
"""

from __future__ import annotations

import logging
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moetier.server.parsers.json_args import JsonArgs
from moetier.server.parsers.xml_args import XmlArgs

log = logging.getLogger("moetier.parsers")


@dataclass
class ToolCallDelta:
    """One piece of a streamed tool call: the first for an index has id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    withdrawn: bool = False  # the call at this index turned out broken: not a call after all

    def openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass
class Delta:
    """What one `feed` (or `finish`) produced, in output order: ("reasoning", str),
    ("content", str) and ("tool_call", ToolCallDelta) parts."""

    parts: list[tuple[str, Any]] = field(default_factory=list)

    def add(self, kind: str, value: Any) -> None:
        if kind == "tool_call":
            if not self.parts or self.parts[-1][0] != "tool_call":
                self.parts.append((kind, value))
                return
            last: ToolCallDelta = self.parts[-1][1]
            if (
                last.index == value.index
                and value.id is None
                and not (value.withdrawn or last.withdrawn)
            ):
                last.arguments += value.arguments
                return
            self.parts.append((kind, value))
            return
        if not value:
            return
        if self.parts and self.parts[-1][0] == kind:
            self.parts[-1] = (kind, self.parts[-1][1] + value)
        else:
            self.parts.append((kind, value))

    def extend(self, other: Delta) -> None:
        for kind, value in other.parts:
            self.add(kind, value)

    @property
    def content(self) -> str:
        return "".join(v for k, v in self.parts if k == "content")

    @property
    def reasoning(self) -> str:
        return "".join(v for k, v in self.parts if k == "reasoning")

    @property
    def tool_calls(self) -> list[ToolCallDelta]:
        return [v for k, v in self.parts if k == "tool_call" and not v.withdrawn]

    def __bool__(self) -> bool:
        return bool(self.parts)

    def openai(self, reasoning_fields: tuple[str, ...] = ("reasoning_content",)) -> dict[str, Any]:
        """The delta as an OpenAI chat.completion.chunk `delta` (without role); the reasoning
        under each of `reasoning_fields` (`reasoning_content`, vLLM's newer `reasoning`)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            for name in reasoning_fields:
                out[name] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [c.openai() for c in self.tool_calls]
        return out


@dataclass
class Message:
    """The assistant message the deltas add up to (OpenAI's non-streaming shape)."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # streamed call index -> the call's dict (indices of withdrawn calls leave gaps)
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    def apply(self, delta: Delta) -> None:
        for kind, value in delta.parts:
            if kind == "content":
                self.content = (self.content or "") + value
            elif kind == "reasoning":
                self.reasoning_content = (self.reasoning_content or "") + value
            elif value.withdrawn:
                call = self._calls.pop(value.index, None)
                if call is not None:
                    self.tool_calls.remove(call)
            else:
                if value.id is not None:
                    call = {
                        "id": value.id,
                        "type": "function",
                        "function": {"name": value.name, "arguments": ""},
                    }
                    self._calls[value.index] = call
                    self.tool_calls.append(call)
                self._calls[value.index]["function"]["arguments"] += value.arguments

    def openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": "assistant",
            "content": self.content,
            "reasoning_content": self.reasoning_content,
        }
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters' JSON schema, from OpenAI (`{"type": "function", "function":
    {...}}`), bare function or Anthropic (`input_schema`) tool definitions."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = fn.get("name")
        if isinstance(name, str):
            schema = fn.get("parameters") or fn.get("input_schema") or {}
            out[name] = schema if isinstance(schema, dict) else {}
    return out


def random_call_id() -> str:
    """OpenAI-style id: call_ and 24 random alphanumerics."""
    return "call_" + "".join(random.choices(string.ascii_letters + string.digits, k=24))


def held_back(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


def _marker_prefix(text: str, markers: tuple[str, ...]) -> bool:
    return any(m.startswith(text) for m in markers)


class _Stripped:
    """A text channel (content or reasoning) that drops the whitespace next to a marker: a
    segment that follows one loses its leading whitespace, a segment a marker ends loses its
    trailing whitespace (held back until it is known what follows). Text with no marker next to
    it (a plain answer, its start and end included) passes unchanged."""

    def __init__(self, after_marker: bool = False) -> None:
        self.after_marker = after_marker  # the segment follows a marker (or the prompt's)
        self.started = False
        self.pending = ""

    def push(self, text: str) -> str:
        if not self.started:
            stripped = text.lstrip()
            if self.after_marker:
                text = stripped
            if not stripped:
                if not self.after_marker:
                    self.pending += text
                return ""
            self.started = True
        text = self.pending + text
        kept = text.rstrip()
        self.pending = text[len(kept) :]
        return kept

    def end(self) -> None:
        """A marker ends the segment: its held whitespace is dropped."""
        self.started = False
        self.pending = ""
        self.after_marker = True

    def flush(self) -> str:
        """The output ended: the held whitespace is text."""
        out, self.pending = self.pending, ""
        return out


class Parser:
    """One model output's streaming parser. Subclasses implement `_step`.

    tools: the request's tool definitions (for argument types and names); starts_in_reasoning:
    the rendered prompt ended inside a reasoning block; parallel_tool_calls: False keeps only the
    first call; call_offset: tool calls earlier in the conversation (Kimi numbers its ids over the
    whole conversation); new_id: the id maker (tests pass a deterministic one); calls: False
    when the request has no tools (or tool_choice none): call markup stays content.
    """

    family = "base"
    # Families whose models are known to open a tool call before closing their reasoning.
    calls_in_reasoning = False
    # Where tool calls begin (ThinkParser families).
    call_markers: tuple[str, ...] = ()
    # Every marker the family's output uses that a tokenizer may hold as one special token:
    # the detokenizer keeps those in the text (serving.py), and no other special token.
    markers: tuple[str, ...] = ()

    def __init__(
        self,
        tools: list[dict[str, Any]] | None = None,
        *,
        starts_in_reasoning: bool = False,
        parallel_tool_calls: bool = True,
        call_offset: int = 0,
        new_id: Callable[[], str] | None = None,
        calls: bool = True,
    ) -> None:
        self.schemas = tool_schemas(tools)
        self.calls_enabled = calls
        if not calls:
            self.call_markers: tuple[str, ...] = ()
        self.parallel_tool_calls = parallel_tool_calls
        self.call_offset = call_offset
        self.new_id = new_id or self.default_id
        self._buf = ""
        self.raw = ""  # the markup of the call being read, as the model wrote it
        self.state = "reasoning" if starts_in_reasoning else "content"
        self.content_started = False  # any non-whitespace content or tool call yet
        self.calls = 0  # tool calls begun (including dropped ones)
        self.call_open = False
        self.dropping = False  # inside a call dropped by parallel_tool_calls=False
        self._json: JsonArgs | None = None
        self._xml: XmlArgs | None = None
        self._param_open = False
        self._index = 0
        self._sent = 0  # calls announced (their first delta sent): the next call's index
        self._header: ToolCallDelta | None = None  # the open call's first delta, until sent
        self._held = ""  # argument fragments waiting for the header
        self.warnings: list[str] = []
        self._out = Delta()
        self._content = _Stripped()
        self._reasoning = _Stripped(after_marker=True)

    @property
    def buf(self) -> str:
        """Text fed but not consumed yet; what is consumed is also added to `raw`."""
        return self._buf

    @buf.setter
    def buf(self, value: str) -> None:
        old = self._buf
        if len(value) < len(old):  # consumed: the new buffer is a suffix of the old one
            self.raw += old[: len(old) - len(value)]
        self._buf = value

    # -- public -------------------------------------------------------------------------------

    def feed(self, text: str) -> Delta:
        """Parts for `text`, the next piece of the output."""
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> Delta:
        """Parts for what was held back, the output having ended (an open reasoning block stays
        reasoning; an open tool call is closed and its arguments repaired)."""
        self._run(final=True)
        self._finish()
        if self.state == "reasoning":
            self._out.add("reasoning", self._reasoning.flush())
        elif not self.dropping:
            self._out.add("content", self._content.flush())
        return self._take()

    def parse(self, text: str) -> Message:
        """The whole output at once, as the message the server returns."""
        message = Message()
        message.apply(self.feed(text))
        message.apply(self.finish())
        message.warnings = list(self.warnings)
        return message

    def default_id(self) -> str:
        return random_call_id()

    # -- for subclasses -----------------------------------------------------------------------

    def _step(self, final: bool) -> bool:
        """Consume what the buffer settles; False when it needs more text."""
        raise NotImplementedError

    def _finish(self) -> None:
        if self.call_open:
            # A call whose JSON arguments are complete may end the output (Mistral, harmony's
            # <|call|> is an end token); anything else open was cut off.
            left = self.buf.strip()
            if self._json is not None:
                self._json_args(self.buf)
            elif self._param_open:
                self._param_text(self.buf)
            elif left and not left.startswith("</") and not _marker_prefix(left, self.markers):
                self._param_open = True  # cut inside a parameter's markup: as if in its value
            self.buf = ""
            self._close_call(cut=True)
        elif self.state == "tool" and (self.buf + self.raw).strip():
            # call markup that never became a call: text
            self.buf = ""
            self._warn(f"the output ended in tool-call markup, kept as content: {self.raw!r}")
            self._emit_raw()
        self.buf = ""

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out

    def _scan(self, markers: tuple[str, ...], final: bool) -> tuple[str, str | None]:
        """(text before the earliest marker, the marker) with both consumed; with no marker in
        the buffer, the text that cannot start one (all of it when final) and None."""
        buf = self.buf
        at, found = -1, None
        for marker in markers:
            i = buf.find(marker)
            if i != -1 and (found is None or i < at or (i == at and len(marker) > len(found))):
                at, found = i, marker
        if found is not None:
            self.buf = buf[at + len(found) :]
            return buf[:at], found
        keep = 0 if final else held_back(buf, markers)
        self.buf = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def _emit_content(self, text: str) -> None:
        if self.dropping:
            return
        out = self._content.push(text)
        if out:
            self.content_started = True
            self._out.add("content", out)

    def _emit_reasoning(self, text: str) -> None:
        self._out.add("reasoning", self._reasoning.push(text))

    def _end_segment(self) -> None:
        self._content.end()
        self._reasoning.end()

    def _open_call(self, name: str, call_id: str | None = None, announce: bool = True) -> bool:
        """Begin a tool call (announced now, or with `_announce` once its arguments start
        well); False (and the call's text is dropped) when parallel calls are off and one was
        already made."""
        self._end_segment()
        self.content_started = True
        self.calls += 1
        self.call_open = True
        if not self.parallel_tool_calls and self._sent > 0:
            self.dropping = True
            return False
        self._index = self._sent
        self._header = ToolCallDelta(self._index, call_id or self.new_id(), name, "")
        self._held = ""
        if announce:
            self._announce()
        return True

    def _announce(self) -> None:
        """Send the open call's first delta and the argument fragments held for it."""
        if self._header is None or self.dropping:
            return
        self._out.add("tool_call", self._header)
        self._header = None
        self._sent += 1
        if self._held:
            self._out.add("tool_call", ToolCallDelta(self._index, arguments=self._held))
            self._held = ""

    def _call_args(self, fragment: str) -> None:
        if not fragment or self.dropping:
            return
        if self._header is not None:
            self._held += fragment
        else:
            self._out.add("tool_call", ToolCallDelta(self._index, arguments=fragment))

    def _open_json_call(self, name: str, call_id: str | None = None) -> None:
        """A call whose arguments the model writes as one JSON object (`_json_args`): announced
        once they start an object (`{"` or `{}`)."""
        self._open_call(name, call_id, announce=False)
        self._json = JsonArgs()

    def _json_args(self, text: str) -> None:
        assert self._json is not None
        self._call_args(self._json.push(text))
        if self._header is not None and self._json.committed:
            self._announce()

    def _open_xml_call(self, name: str, call_id: str | None = None) -> None:
        """A call whose arguments come one parameter at a time (`_param_*`): always valid JSON,
        so announced at once."""
        self._open_call(name, call_id)
        self._xml = XmlArgs(self.schemas.get(name))

    def _param_begin(self, key: str, raw: bool | None = None) -> None:
        assert self._xml is not None
        if self._param_open:
            self._param_end()
        self._param_open = True
        self._call_args(self._xml.begin(key, raw))

    def _param_text(self, text: str) -> None:
        assert self._xml is not None
        self._call_args(self._xml.chunk(text))

    def _param_end(self) -> None:
        assert self._xml is not None
        self._param_open = False
        self._call_args(self._xml.end())

    def _close_call(self, trailer: str = "", carry: str = "", cut: bool = False) -> None:
        """End the open call. JSON arguments: complete ones pass; ones that only lack closing
        brackets are closed (a warning); any others make the call content (a warning). XML-style
        arguments: a parameter left open by a later marker is closed; one the end of the output
        cut (`cut`) makes the call content. `trailer`: characters the format puts after the
        arguments (a wrapper's brace, a code fence), ignored; `carry`: the end of `raw` that
        already begins the next call."""
        raw = self.raw[: len(self.raw) - len(carry)] if carry else self.raw
        status = "complete"
        if self._json is not None:
            fragment, status = self._json.close()
            if status != "broken":
                self._call_args(fragment)
            rest = self._json.rest.strip().strip(trailer).strip()
            if status == "complete" and rest and not self.dropping:
                self._warn(f"text after a tool call's arguments ignored: {self._json.rest[:80]!r}")
        if self._xml is not None:
            if self._param_open and cut:
                status = "broken"
            else:
                if self._param_open:
                    self._param_end()
                self._call_args(self._xml.close())
                status = "repaired" if cut else "complete"
        if self.dropping:
            pass
        elif status == "broken":
            what = "cut off" if cut else "not valid JSON"
            self._warn(f"tool call arguments {what}; the call is passed on as content: {raw!r}")
            if self._header is None:  # announced: the stream has it, the message drops it
                self._out.add("tool_call", ToolCallDelta(self._index, withdrawn=True))
            self._header = None
            self._held = ""
            self._emit_raw(raw)
        else:
            if status == "repaired":
                self._warn("tool call arguments ended early; closed (only closers were missing)")
            self._announce()
        self._json = None
        self._xml = None
        self._param_open = False
        self._header = None
        self.call_open = False
        self.dropping = False
        self.raw = carry

    def _emit_raw(self, raw: str | None = None) -> None:
        """Markup that is not a call after all, as content."""
        self._end_segment()
        self._emit_content(self.raw if raw is None else raw)
        self._end_segment()
        self.raw = ""

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        log.warning("%s parser: %s", self.family, text)


class ThinkParser(Parser):
    """Families with reasoning between two markers and tool calls that begin at one of
    `call_markers`; subclasses implement `_tool_step` (the call syntax) and set `state` back to
    "content" when the calls end.

    In content, `think_start` opens reasoning only before any content (a stray `think_end` is
    dropped); in reasoning, a call marker ends the reasoning for the families whose models open
    calls there (`calls_in_reasoning`), and is reasoning text for the others.
    """

    think_start = "<think>"
    think_end = "</think>"

    @classmethod
    def prompt_ends_in_reasoning(cls, prompt: str) -> bool:
        """Whether a rendered prompt leaves the model inside a reasoning block."""
        return prompt.rstrip().endswith(cls.think_start)

    def _step(self, final: bool) -> bool:
        if self.state == "content":
            return self._content_step(final)
        if self.state == "reasoning":
            return self._reasoning_step(final)
        return self._tool_step(final)

    def _content_step(self, final: bool) -> bool:
        markers = self.call_markers + (self.think_end,)
        if not self.content_started:
            markers += (self.think_start,)
        text, marker = self._scan(markers, final)
        if marker == self.think_start and text.strip():
            # content came first: this is text (as it is when that content was fed before)
            self._emit_content(text + marker)
            return True
        self._emit_content(text)
        if marker is None:
            return False
        self._end_segment()
        if marker == self.think_start:
            self.state = "reasoning"
        elif marker in self.call_markers:
            self.state = "tool"
            self.raw = marker
            self._enter_tool(marker)
        return True

    def _reasoning_step(self, final: bool) -> bool:
        markers: tuple[str, ...] = (self.think_end,)
        if self.calls_in_reasoning:
            markers += self.call_markers
        if not self._reasoning.started:
            markers += (self.think_start,)
        text, marker = self._scan(markers, final)
        if marker == self.think_start and text.strip():
            self._emit_reasoning(text + marker)  # reasoning came first: this is text
            return True
        self._emit_reasoning(text)
        if marker is None:
            return False
        if marker == self.think_start:
            return True  # the model repeated the opening the prompt already has
        self._end_segment()
        if marker == self.think_end:
            self.state = "content"
        else:
            self.state = "tool"
            self.raw = marker
            self._enter_tool(marker)
        return True

    def _enter_tool(self, marker: str) -> None:
        self.sub = "start"

    def _tool_step(self, final: bool) -> bool:
        raise NotImplementedError

    def _wait_for(self, marker: str, final: bool) -> str | None:
        """The buffer's text before `marker` (both consumed); None while `marker` has not come
        (what is left at the end of the output is dropped with a warning)."""
        at = self.buf.find(marker)
        if at == -1:
            return None
        text = self.buf[:at]
        self.buf = self.buf[at + len(marker) :]
        return text

    def _skip_to(self, markers: tuple[str, ...], final: bool) -> str | None:
        """Drop text up to the earliest of `markers`; the marker, or None (needs more text)."""
        _, marker = self._scan(markers, final)
        return marker
