"""The parsers inside the server: which family a model gets (once, at start-up), one request's
parsing of the engine's outputs into the deltas of its API, and the tool calls of the history
in the shape the family's chat template reads.

The API modules call three things: `choose_parser` when the model is ready, `template_history`
before rendering a conversation, and a `ChatParsing` per request, whose `push(output)` returns
the `Delta` for that engine output (reasoning, content and tool-call parts, in order). The
parser reads its own detokenization of the output's token ids, in which the family's markers
stay even where they are special tokens (the engine's text drops every special token); other
special tokens and the end tokens stay out. A model no
family fits, or `--tool-parser none`, is served as plain text: the engine's text as it is.
`anthropic_blocks` and `AnthropicStream` turn the same parts into Anthropic content blocks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

from moetier.engine.detokenizer import StreamingDetokenizer
from moetier.engine.prompts import chat_prompt_ids
from moetier.engine.sampler import SamplingParams
from moetier.server.parsers.base import Delta, Message, Parser
from moetier.server.parsers.forced import forced_call_grammar
from moetier.server.parsers.registry import FAMILIES, choose_family, family_name
from moetier.server.renderers import renderer_for

log = logging.getLogger("moetier.parsers")

# Families whose templates write a call's arguments as they are given (a JSON string); the
# others iterate them (`arguments|items`) or write them with `tojson`: those get a mapping.
STRING_ARGUMENTS = {"deepseek_v3", "deepseek_v31"}

# The history's reasoning (reasoning_content, vLLM's `reasoning`, Anthropic thinking blocks,
# Responses reasoning items) and the chat template: the `reasoning_history` key of
# chat_template_kwargs (server-wide: --default-chat-template-kwargs) says
#   "template" (the default): handed to the template, which keeps what the family keeps (most
#       keep the turns after the last user message: the reasoning of an agent's tool loop);
#   "keep": also the family's own switch for keeping every turn's, where its template has one;
#   "drop": not handed to the template.
REASONING_HISTORY = ("template", "keep", "drop")
KEEP_ALL_REASONING: dict[str, dict[str, Any]] = {
    "glm47": {"clear_thinking": False},  # GLM-4.7 / 5 "preserved thinking"
    "deepseek_v4": {"drop_thinking": False},  # DeepSeek's encoder (server/renderers)
}


@dataclass(frozen=True)
class ParserChoice:
    """The family serving this model (None: plain text) and why."""

    family: str | None
    reason: str

    def describe(self) -> dict[str, Any]:
        """For /v1/models: one parser reads both reasoning and tool calls."""
        return {"tool_parser": self.family, "reasoning_parser": self.family}


def choose_parser(
    model_type: str | None,
    chat_template: Any,
    tool_parser: str = "",
    reasoning_parser: str = "",
    quiet: bool = False,
) -> ParserChoice:
    """The family for a model, logged (unless quiet): `--tool-parser` / `--reasoning-parser`
    (one family reads both, so they must agree; "none": plain text), else the chat template's
    markers, else the model_type; none fits: plain text and one warning. ValueError for an
    unknown name."""
    given = {name.strip().lower() for name in (tool_parser, reasoning_parser) if name.strip()}
    if given:
        families = {None if g == "none" else family_name(g) for g in given}
        if len(families) > 1:
            raise ValueError(
                f"--tool-parser {tool_parser!r} and --reasoning-parser {reasoning_parser!r} name "
                "different families: one parser reads both, give one of them (or the same)"
            )
        family = families.pop()
        choice = ParserChoice(family, "set by --tool-parser / --reasoning-parser")
    else:
        template = chat_template
        if isinstance(template, dict):  # named templates: all of them
            template = "\n".join(str(t) for t in template.values())
        family, why = choose_family(model_type, template if isinstance(template, str) else None)
        choice = ParserChoice(family, why)
        if family is None:
            if not quiet:
                log.warning(
                    "no reasoning / tool-call parser for this model (%s): serving plain text; "
                    "choose one with --tool-parser (%s)",
                    why,
                    ", ".join(sorted(FAMILIES)),
                )
            return choice
    if not quiet:
        log.info("reasoning and tool-call parser: %s (%s)", choice.family or "none", choice.reason)
    return choice


REASONING_FIELDS = {
    "reasoning_content": ("reasoning_content",),
    "reasoning": ("reasoning",),
    "both": ("reasoning_content", "reasoning"),
}


def check_parser_flags(tool_parser: str, reasoning_parser: str, reasoning_field: str = "") -> None:
    """ValueError now (before the model loads) for a parser name no family has, or a
    --reasoning-field that is not one of REASONING_FIELDS."""
    if tool_parser or reasoning_parser:
        choose_parser(None, None, tool_parser, reasoning_parser, quiet=True)
    if reasoning_field and reasoning_field not in REASONING_FIELDS:
        raise ValueError(
            f"--reasoning-field {reasoning_field!r}: use one of {', '.join(REASONING_FIELDS)}"
        )


def reasoning_fields(option: str) -> tuple[str, ...]:
    """The OpenAI chat fields that carry reasoning, for --reasoning-field."""
    return REASONING_FIELDS.get(option or "reasoning_content", ("reasoning_content",))


def parser_for_engine(
    engine: Any, tool_parser: str = "", reasoning_parser: str = ""
) -> ParserChoice:
    """The choice for a loaded AsyncEngine: its store's model_type and chat template."""
    loaded = engine.engine.loaded
    return choose_parser(
        getattr(loaded.model_config, "model_type", None),
        getattr(engine.tokenizer, "chat_template", None),
        tool_parser,
        reasoning_parser,
    )


def prepare_chat(
    engine: Any,
    choice: ParserChoice | None,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    relaxed: bool = False,
) -> tuple[list[int], SamplingParams, ChatParsing]:
    """A chat request's prompt ids (its history in the family's shapes, its tools unless
    tool_choice is none, `template_kwargs` such as enable_thinking as template variables), its
    sampling params (a forced tool_choice adds the call's grammar) and its parsing (its reasoning
    state from the rendered prompt); ValueError for what cannot be served (a 400). `relaxed`
    (--relaxed-chat-template): a conversation the template refuses is tried once more with its
    system messages joined into one at the front."""
    choice = choice or ParserChoice(None, "no parser chosen")
    tool_choice = "auto" if tool_choice is None else tool_choice
    offered = tools if tools and tool_choice != "none" else None
    reserved = {"messages", "tools", "add_generation_prompt", "tokenize"} & set(
        template_kwargs or {}
    )
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    template_kwargs = reasoning_history_kwargs(template_kwargs, choice.family)
    keep = template_kwargs.pop("reasoning_history") != "drop"
    messages = template_history(messages, choice.family, reasoning=keep)
    continuing = bool(messages) and messages[-1].get("role") == "assistant"
    try:
        prompt_ids = render_prompt_ids(engine, messages, offered, template_kwargs, continuing)
    except ValueError:
        moved = system_first(messages)
        if not relaxed or moved == messages:
            raise
        prompt_ids = render_prompt_ids(engine, moved, offered, template_kwargs, continuing)
    prefill = messages[-1].get("content") if continuing else None
    forced_reader = None
    if forced_tool_choice(tool_choice):
        # a named tool is called once (as vLLM does); required / any: as parallel_tool_calls
        if isinstance(tool_choice, dict) and tool_choice.get("type") in ("function", "tool"):
            parallel_tool_calls = False
        if params.grammar is not None:
            raise ValueError(
                "tool_choice that forces a call cannot be combined with response_format"
            )
        # in the family's own call syntax where its arguments are one JSON object (forced.py)
        grammar, forced_reader = forced_call_grammar(
            choice.family,
            tools or [],
            tool_choice,
            parallel_tool_calls,
            engine.tokenizer,
            count_calls(messages),
        )
        params = dataclasses.replace(params, grammar=grammar)
    parsing = ChatParsing(
        choice,
        engine.tokenizer,
        prompt_ids,
        tools=offered,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        call_offset=count_calls(messages),
        stop=params.stop,
        end_ids=frozenset(engine.engine.chat_end_ids),
        prefill=prefill if isinstance(prefill, str) else None,
        forced_family=forced_reader,
    )
    return prompt_ids, params, parsing


def render_prompt_ids(
    engine: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    continue_final: bool,
) -> list[int]:
    """The prompt ids through the store's chat template, or, for a store without one whose
    family ships its own encoder instead (DeepSeek-V4: server/renderers), through that
    encoder's rendering; ValueError for what neither can render."""
    loaded = getattr(getattr(engine, "engine", None), "loaded", None)
    model_type = getattr(getattr(loaded, "model_config", None), "model_type", None)
    render = renderer_for(model_type, engine.tokenizer)
    if render is None:
        return chat_prompt_ids(
            engine.tokenizer, messages, tools, template_kwargs, continue_final=continue_final
        )
    text = render(messages, tools, template_kwargs, continue_final)
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def forced_tool_choice(tool_choice: Any) -> bool:
    """Whether `tool_choice` forces a call (required, any, or a named tool)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return False
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("auto", "none"):
        return False
    return True


def reasoning_history_kwargs(kwargs: dict[str, Any] | None, family: str | None) -> dict[str, Any]:
    """The template variables with `reasoning_history` checked (ValueError: a 400) and filled in
    ("template" when not given); "keep" adds the family's keep-every-turn switch unless the
    request set it itself."""
    out = dict(kwargs or {})
    mode = out.get("reasoning_history", "template")
    if mode not in REASONING_HISTORY:
        raise ValueError(
            f"chat_template_kwargs.reasoning_history {mode!r}: use one of "
            + ", ".join(REASONING_HISTORY)
        )
    out["reasoning_history"] = mode
    if mode == "keep":
        for key, value in KEEP_ALL_REASONING.get(family or "", {}).items():
            out.setdefault(key, value)
    return out


def template_history(
    messages: list[dict[str, Any]], family: str | None, reasoning: bool = True
) -> list[dict[str, Any]]:
    """Chat messages as the family's template reads them: tool-call arguments a mapping (or a
    JSON string for templates that write them as given), `reasoning` as `reasoning_content`, and
    gpt-oss's `thinking`; reasoning False (reasoning_history "drop"): the assistant messages'
    reasoning left out. The messages are copied, not changed."""
    out = []
    for message in messages:
        message = dict(message)
        if not reasoning and message.get("role") == "assistant":
            for key in ("reasoning_content", "reasoning", "thinking"):
                message.pop(key, None)
        if message.get("reasoning") and not message.get("reasoning_content"):
            message["reasoning_content"] = message["reasoning"]
        if family == "harmony" and message.get("reasoning_content"):
            message.setdefault("thinking", message["reasoning_content"])
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [_template_call(c, family) for c in calls]
            if family == "deepseek_v3" and not message.get("content"):
                message["content"] = None  # its template renders calls only for null content
        out.append(message)
    return out


def _template_call(call: dict[str, Any], family: str | None) -> dict[str, Any]:
    call = dict(call)
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if family in STRING_ARGUMENTS:
        if not isinstance(args, str):
            function["arguments"] = json.dumps(args if args is not None else {})
    elif isinstance(args, str):
        try:
            loaded = json.loads(args) if args.strip() else {}
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            function["arguments"] = loaded
    call["function"] = function
    return call


def system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its system messages joined (blank line between) into one at the
    front: what templates that insist on "system message first" accept (Claude Code sends
    system reminders mid-conversation)."""
    systems = [m for m in messages if m.get("role") == "system"]
    if not systems:
        return messages
    text = "\n\n".join(str(m.get("content") or "") for m in systems)
    return [{"role": "system", "content": text}] + [m for m in messages if m not in systems]


def count_calls(messages: list[dict[str, Any]]) -> int:
    """Tool calls in a conversation's history (Kimi numbers its call ids over it)."""
    return sum(len(m.get("tool_calls") or ()) for m in messages if m.get("role") == "assistant")


_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def special_ids(tokenizer: Any, keep: tuple[str, ...]) -> frozenset[int]:
    """The tokenizer's special tokens, less those whose text is one of `keep` (a family's
    markers): what the parser's detokenization leaves out, as the engine's does. Computed once
    per tokenizer and family."""
    try:
        known = _SPECIAL_IDS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: no cache
        return _special_ids(tokenizer, keep)
    if keep not in known:
        known[keep] = _special_ids(tokenizer, keep)
    return known[keep]


def _special_ids(tokenizer: Any, keep: tuple[str, ...]) -> frozenset[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(i))
    wanted = set(keep)
    return frozenset(i for i in ids if tokenizer.convert_ids_to_tokens(i) not in wanted)


def prefill_in_reasoning(cls: type[Parser], prefill: str, rendered: bool) -> bool:
    """Whether the model continues an assistant message inside its reasoning: its last reasoning
    marker decides (`<think>` open: yes; `</think>` last: no, ds4 #897), else what the template
    rendered before it (`rendered`)."""
    start = getattr(cls, "think_start", None)
    end = getattr(cls, "think_end", None)
    if not start or not end:
        return rendered
    opened, closed = prefill.rfind(start), prefill.rfind(end)
    if opened == closed == -1:
        return rendered
    return opened > closed


@dataclass
class ChatParsing:
    """One request's parsing of engine outputs.

    choice: the server's family; tokenizer and prompt_ids: the model's, for the detokenization
    and the reasoning state the prompt leaves; tools, tool_choice, parallel_tool_calls: the
    request's; call_offset: calls earlier in the conversation; stop: its stop strings; end_ids:
    the tokens that end a turn (never text).
    """

    choice: ParserChoice
    tokenizer: Any
    prompt_ids: list[int]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    call_offset: int = 0
    stop: tuple[str, ...] = ()
    end_ids: frozenset[int] = frozenset()
    prefill: str | None = None  # the assistant message the model continues, if it does
    forced_family: str | None = None  # the parser of a grammar-forced call (forced.py)
    message: Message = field(default_factory=Message)

    def __post_init__(self) -> None:
        self.parser: Parser | None = None
        self.detok: StreamingDetokenizer | None = None
        self.starts_in_reasoning = False  # whether the prompt leaves the output in reasoning
        # generated tokens read in reasoning: those the parser reads while in reasoning or that
        # take it there (the markers that open and close the reasoning included)
        self.reasoning_tokens = 0
        calls = bool(self.tools) and self.tool_choice != "none"
        if forced_tool_choice(self.tool_choice):
            # the grammar writes the call from the first token on, in this family's syntax
            self.parser = FAMILIES[self.forced_family or "hermes"](
                self.tools,
                parallel_tool_calls=self.parallel_tool_calls,
                call_offset=self.call_offset,
            )
        elif self.choice.family is not None:
            cls = FAMILIES[self.choice.family]
            tail = self.tokenizer.decode(self.prompt_ids[-32:], skip_special_tokens=False)
            starts = bool(cls.prompt_ends_in_reasoning(tail))  # type: ignore[attr-defined]
            if self.prefill is not None:  # a continued message: where its own markers leave it
                starts = prefill_in_reasoning(cls, self.prefill, starts)
            self.starts_in_reasoning = starts
            self.parser = cls(
                self.tools,
                starts_in_reasoning=starts,
                parallel_tool_calls=self.parallel_tool_calls,
                call_offset=self.call_offset,
                calls=calls,
            )
            start = getattr(cls, "think_start", "")
            if starts and self.prefill and not self.prefill.rstrip().endswith(start):
                self.parser._reasoning.after_marker = False  # it goes on mid-sentence
        if self.parser is not None:
            hidden = special_ids(self.tokenizer, type(self.parser).markers) | self.end_ids
            self.detok = StreamingDetokenizer(
                self.tokenizer, self.stop, keep_special=True, hidden=hidden
            )

    @property
    def active(self) -> bool:
        return self.parser is not None

    def push(self, out: Any) -> Delta:
        """The delta for one engine `Output` (its text, or its token ids when a parser reads
        them); the last output (finish_reason set) also flushes what was held back."""
        delta = Delta()
        if self.parser is None or self.detok is None:
            delta.add("content", out.text)
        else:
            parser = self.parser
            for token in out.token_ids:
                if self.detok.stopped:
                    break
                before = parser.state
                text = self.detok.push(int(token))[0]
                if text:  # fed token by token, to know each token's state
                    delta.extend(parser.feed(text))
                if "reasoning" in (before, parser.state):
                    self.reasoning_tokens += 1
            if out.finish_reason is not None and not self.detok.stopped:
                text = self.detok.flush()
                if text:
                    delta.extend(parser.feed(text))
            if out.finish_reason is not None:
                delta.extend(self.parser.finish())
                self.message.warnings = list(self.parser.warnings)
        self.message.apply(delta)
        return delta

    def openai_message(
        self, reasoning_fields: tuple[str, ...] = ("reasoning_content",)
    ) -> dict[str, Any]:
        """The whole answer as an OpenAI chat message (content null beside tool calls), the
        reasoning under each of `reasoning_fields`."""
        message = self.message
        out: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.content is None and not message.tool_calls:
            out["content"] = ""
        if message.reasoning_content is not None:
            for name in reasoning_fields:
                out[name] = message.reasoning_content
        if message.tool_calls:
            out["tool_calls"] = message.tool_calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason: tool_calls when the answer made calls and ended by itself."""
        if reason == "stop" and self.message.tool_calls:
            return "tool_calls"
        return reason

    def stop_reason(self, reason: str | None) -> str | None:
        """Anthropic's stop_reason: tool_use when the answer made calls and ended by itself."""
        if reason in ("end_turn", "stop_sequence") and self.message.tool_calls:
            return "tool_use"
        return reason


# A thinking block's `signature`: Anthropic's servers sign their models' thinking so that it can
# be sent back; nothing here signs or checks it, so every block carries this same (empty) one,
# whole or streamed (a signature_delta before the block's stop, as Anthropic streams it)
SIGNATURE = ""


def anthropic_blocks(message: Message) -> list[dict[str, Any]]:
    """A whole answer as Anthropic content blocks: thinking, text, tool_use (input an object)."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        thinking = message.reasoning_content
        blocks.append({"type": "thinking", "thinking": thinking, "signature": SIGNATURE})
    if message.content or not blocks and not message.tool_calls:  # never no block at all
        blocks.append({"type": "text", "text": message.content or ""})
    for call in message.tool_calls:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": json.loads(function["arguments"] or "{}"),
            }
        )
    return blocks


class AnthropicStream:
    """Deltas -> Anthropic stream events (name, data): a block opens when its kind of part
    starts (thinking, text, tool_use) and closes when another begins; tool arguments arrive as
    input_json_delta fragments.

    A tool call's block is held back until the call is known whole (the next part, or the
    end, comes and the parser has not withdrawn it), then sent at once: Anthropic's SDKs read
    a tool_use block's partial JSON leniently, so a call cut by max_tokens or broken mid-way
    would reach the client as a call with made-up input (`{}`, or a file's content cut short),
    where the parser gives its markup back as text (as the answer sent whole has it)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.held: tuple[int, dict[str, Any], list[str]] | None = None  # call index, block, args

    @property
    def holding(self) -> bool:
        """Whether a tool call is held back (the stream is quiet meanwhile: keep it alive)."""
        return self.held is not None

    def events(self, delta: Delta) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for kind, value in delta.parts:
            if kind != "tool_call" or value.id is not None:
                self._release(out)  # a part after a held call: the call ended whole
            if kind == "reasoning":
                self._begin(out, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": value}))
            elif kind == "content":
                self._begin(out, "text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": value}))
            elif value.withdrawn:  # not a call after all: its markup follows as text
                if self.held is not None and self.held[0] == value.index:
                    self.held = None
            else:
                if value.id is not None:
                    block = {"type": "tool_use", "id": value.id, "name": value.name, "input": {}}
                    self.held = (value.index, block, [])
                if value.arguments and self.held is not None:
                    self.held[2].append(value.arguments)
        return out

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """The last block's stop (an answer with no block at all gets an empty text block)."""
        out: list[tuple[str, dict[str, Any]]] = []
        self._release(out)
        if self.open is None:
            self._begin(out, "text", {"type": "text", "text": ""})
        self._stop(out)
        self.open = None
        return out

    def _release(self, out: list[tuple[str, dict[str, Any]]]) -> None:
        """Send the held call's block: its start and its arguments in one fragment."""
        if self.held is None:
            return
        _, block, fragments = self.held
        self.held = None
        self._begin(out, "tool_use", block, new=True)
        if fragments:
            out.append(
                self._delta({"type": "input_json_delta", "partial_json": "".join(fragments)})
            )

    def _begin(
        self,
        out: list[tuple[str, dict[str, Any]]],
        kind: str,
        block: dict[str, Any],
        new: bool = False,
    ) -> None:
        if self.open == kind and not new:
            return
        if self.open is not None:
            self._stop(out)
        self.index += 1
        self.open = kind
        out.append(("content_block_start", {"index": self.index, "content_block": block}))

    def _stop(self, out: list[tuple[str, dict[str, Any]]]) -> None:
        """The open block's stop; a thinking block's signature comes first, as Anthropic sends
        it (a signature_delta), the same placeholder as the whole answer's (SIGNATURE)."""
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        out.append(("content_block_stop", {"index": self.index}))

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"index": self.index, "delta": delta})


def template_kwargs(
    defaults: dict[str, Any] | None, request: dict[str, Any] | None
) -> dict[str, Any]:
    """The chat template's variables: the request's `chat_template_kwargs` over the server's
    `--default-chat-template-kwargs`."""
    return {**(defaults or {}), **(request or {})}


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """`--default-chat-template-kwargs`: a JSON object; ValueError otherwise."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    return value


def anthropic_thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's `thinking` ({"type": "enabled"} or "disabled") as the template variables the
    hybrid templates read (Qwen3 and GLM `enable_thinking`, DeepSeek `thinking`)."""
    kind = (thinking or {}).get("type")
    if kind not in ("enabled", "disabled"):
        return {}
    on = kind == "enabled"
    return {"enable_thinking": on, "thinking": on}
