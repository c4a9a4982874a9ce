"""Structured output: grammars that constrain sampling (JSON schema, any JSON object, regex,
EBNF / Lark, structural tags), compiled and matched by llguidance.

A request's `SamplingParams.grammar` is a (kind, spec) pair, kind one of `KINDS`. The engine asks
`GrammarBackend.matcher(kind, spec)` for one `Matcher` per request; before each sampling step it
fills the request's row of an int32 bitmask (`Matcher.fill_next_token_bitmask`), masks the
logits with it (`apply_bitmask`), and hands the sampled token back (`Matcher.accept_token`).
The model's end tokens end the grammar: once the document is complete they are the only tokens
allowed, and accepting one terminates the matcher.

`check_grammar` validates a (kind, spec) without a tokenizer, for the server to answer a bad
schema with a 400 before the request is queued. `tool_call_grammar` builds the grammar of a
forced tool call (`tool_choice` required or named).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from functools import lru_cache
from typing import Any, cast

import llguidance
import torch

from moetier.engine.detokenizer import END_OF_TURN_TOKENS

KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")

# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace. A flexible
# whitespace rule lets a model (a random or small one above all) run on in spaces and newlines
# until max_tokens cuts the document short. A schema's own "x-guidance" key overrides this.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,  # oneOf matched as anyOf (pydantic writes oneOf for unions)
}

_CACHE_SIZE = 64

# keywords whose value is one subschema, a list of them, or a map of name -> subschema
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "additionalItems")  # fmt: skip
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that lists its `properties` and says nothing of others
    closed to them (`additionalProperties: false`), as vLLM's default grammar backend (xgrammar)
    and OpenAI's strict mode read it. JSON Schema's own default lets such an object take any
    other key, and a model held to a schema then writes keys it made up (a tool's arguments
    beside the ones it declares). An object without `properties` (free-form) stays open.
    A copy; the input is unchanged."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def _json_schema_grammar(schema: Any) -> str:
    if isinstance(schema, bool):  # the schemas `true` (anything) and `false` (nothing)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, not {type(schema).__name__}")
    schema = closed_objects(schema)
    try:
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=cast(Any, JSON_OPTIONS))
        )
    except ValueError as err:
        raise ValueError(f"invalid JSON schema: {err}") from err


def _parse_json(kind: str, spec: str) -> Any:
    try:
        return json.loads(spec)
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"the {kind} spec is not valid JSON: {err}") from err


def _structural_tag_grammar(spec: Any) -> str:
    """The structural-tag form vLLM and xgrammar take: {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}: free text, and wherever a trigger appears, one of the structures
    that begins with it (its schema-valid JSON between begin and end)."""
    if not isinstance(spec, dict):
        raise ValueError("a structural_tag spec must be a JSON object")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError('a structural_tag needs a non-empty "structures" list')
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError('a structural_tag needs a "triggers" list of non-empty strings')
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str):
            raise ValueError('each structural_tag structure needs a "begin" string')
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structure begin {s['begin']!r} starts with none of the triggers")
        schema = s.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"the schema of structure {s['begin']!r} must be a JSON object")
        schema = {"x-guidance": JSON_OPTIONS, **closed_objects(schema)}
        end = s.get("end", "")
        if not isinstance(end, str):
            raise ValueError(f'the "end" of structure {s["begin"]!r} must be a string')
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=end)
        )
    # Triggers are text (as in xgrammar), not special-token names.
    return str(llguidance.StructTag.to_grammar(tags, assume_special=False))


@lru_cache(maxsize=_CACHE_SIZE)
def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar of (kind, spec); ValueError for an unknown kind or a spec that is
    not even well-formed (a grammar that is well-formed but wrong fails in `check_grammar`)."""
    if kind == "json_object":
        return _json_schema_grammar({"type": "object"})
    if not isinstance(spec, str):
        raise ValueError(f"the {kind} spec must be a string")
    if kind == "json_schema":
        return _json_schema_grammar(_parse_json(kind, spec))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec))
    if kind == "ebnf":  # GBNF (llama.cpp's) or Lark (llguidance's, with %json and special tokens)
        return str(llguidance.grammar_from("ebnf", spec))
    if kind == "structural_tag":
        return _structural_tag_grammar(_parse_json(kind, spec))
    raise ValueError(f"unknown grammar kind {kind!r}: use one of {', '.join(KINDS)}")


def check_grammar(kind: str, spec: str) -> None:
    """ValueError, with the compiler's message, unless (kind, spec) compiles. Needs no tokenizer
    (the special tokens a Lark grammar names are checked when a matcher is made)."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(kind, spec))
    if failed:  # (warnings alone pass)
        raise ValueError(f"invalid {kind} grammar: {messages[0].strip()}")


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, end_ids: frozenset[int], words: int) -> None:
        self._matcher = matcher
        self._end_ids = end_ids
        self._words = words  # ceil(vocab_size / 32): a bitmask row's length
        self._terminated = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Writes the tokens allowed next into row `index` of `bitmask` (int32 [R, ceil(V/32)] on
        the CPU, contiguous): bit j of word w allows token 32*w + j. Once terminated (or after a
        token the grammar refused), only the end tokens are allowed, so the request ends."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise ValueError("the bitmask must be a 2-D int32 tensor on the CPU")
        row = bitmask[index]
        if not row.is_contiguous():
            raise ValueError("the bitmask's rows must be contiguous")
        if row.numel() != self._words:
            raise ValueError(
                f"bitmask rows of {row.numel()} words: use ceil(vocab/32) = {self._words}"
            )
        if self._terminated or self._matcher.is_error():
            row.zero_()
            for t in self._end_ids:
                if t < 32 * row.numel():
                    row[t // 32] |= _bit(t % 32)
            return
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept_token(self, token: int) -> bool:
        """Advances by the sampled token; False if the grammar does not allow it (the matcher
        then allows only end tokens)."""
        if self._terminated:
            return token in self._end_ids
        ok = bool(self._matcher.consume_token(token))
        if ok and token in self._end_ids:
            self._terminated = True
        return ok

    def is_terminated(self) -> bool:
        """True once an end token completed the document."""
        return self._terminated

    def is_accepting(self) -> bool:
        """True when the text so far is a complete document (an end token may come next)."""
        return self._terminated or bool(self._matcher.is_accepting())


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int that fits int32 (bit 31 is negative)."""
    return -(2**31) if j == 31 else 1 << j


class GrammarBackend:
    """Grammars over one model's tokenizer. `vocab_size` is the logits' width: ids at or past the
    tokenizer's vocabulary are never allowed. `end_token_ids` end a document (default: the
    tokenizer's eos and the chat end tokens in its vocabulary); the engine passes its own."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, end_token_ids: Iterable[int] | None = None
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                "structured output needs a fast tokenizer (the store's tokenizer.json); "
                f"{type(tokenizer).__name__} has none"
            )
        if end_token_ids is None:
            vocab = tokenizer.get_vocab()
            end_token_ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
            if tokenizer.eos_token_id is not None:
                end_token_ids.add(tokenizer.eos_token_id)
        self.end_ids = frozenset(int(t) for t in end_token_ids if 0 <= int(t) < vocab_size)
        if not self.end_ids:
            raise ValueError("structured output needs an end token id within the vocabulary")
        self.vocab_size = vocab_size
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens, more than the model's {vocab_size} "
                "logits: structured output cannot map them"
            )
        backend = copy.copy(backend)  # as llguidance.hf does: the model's own one stays as it is
        backend.no_padding()
        backend.no_truncation()
        self._tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=sorted(self.end_ids)
        )
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _compile(self, kind: str, spec: str) -> llguidance.LLMatcher:
        key = (kind, spec)
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(kind, spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {kind} grammar: {matcher.get_error().strip()}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, kind: str, spec: str) -> None:
        """ValueError, with a message for the client, unless (kind, spec) compiles over this
        tokenizer (a Lark grammar's special tokens included)."""
        self._compile(kind, spec)

    def matcher(self, kind: str, spec: str) -> Matcher:
        """A fresh matcher at the start of the grammar (compiled grammars are cached)."""
        words = -(-self.vocab_size // 32)
        return Matcher(self._compile(kind, spec).deep_copy(), self.end_ids, words)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets, in place, the logits [R, V] of tokens the bitmask [R, ceil(V/32)] int32 does not
    allow to -inf (bit j of word w allows token 32*w + j; a row of -1 words allows everything).
    The bitmask may be on the CPU: it is copied to the logits' device here (non-blocking when
    pinned). Works on CPU and CUDA; no host sync."""
    rows, vocab = logits.shape
    mask = bitmask.to(logits.device, non_blocking=True)
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().reshape(rows, -1)
    if allowed.shape[1] < vocab:
        raise ValueError(f"the bitmask covers {allowed.shape[1]} tokens, the logits {vocab}")
    logits.masked_fill_(~allowed[:, :vocab], float("-inf"))


def _tool_name_and_schema(tool: Any) -> tuple[str, dict[str, Any]]:
    """(name, parameters schema) of an OpenAI tool {"type": "function", "function": {...}} or an
    Anthropic tool {"name", "input_schema"}."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("each tool needs a function name")
    schema = fn.get("parameters", fn.get("input_schema"))
    if schema is None:  # no parameters: the empty object
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(schema, dict):
        raise ValueError(f"the parameters of tool {fn['name']!r} must be a JSON schema object")
    return fn["name"], schema


def tool_call_grammar(
    tools: list[Any],
    tool_choice: Any,
    begin: str = "",
    end: str = "",
    parallel: bool = False,
    separator: str = "\n",
    tokenizer: Any = None,
) -> tuple[str, str] | None:
    """The grammar (kind, spec) of a forced tool call, or None when `tool_choice` forces none
    ("auto", "none", absent).

    `tool_choice` "required" / "any" / {"type": "any"} allows any of `tools`; {"type":
    "function", "function": {"name": N}} or {"type": "tool", "name": N} only N. The call is
    written `begin` + {"name": N, "arguments": {...}} + `end`, the arguments valid against the
    tool's schema; `begin` and `end` are the family's markers as text (e.g. "<tool_call>\\n" and
    "\\n</tool_call>"); with `tokenizer`, a part of a marker that is one of its added tokens
    must be that token (as the model writes it), not its text spelled in other tokens (pass
    it whenever a marker is a token: llguidance's mask offers the token for such text but its
    matcher then refuses it).
    `parallel`: one or more calls joined by `separator`."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("auto", "none"):
        return None
    named = {_tool_name_and_schema(t)[0]: _tool_name_and_schema(t)[1] for t in tools or []}
    if tool_choice in ("required", "any") or (
        isinstance(tool_choice, dict) and tool_choice.get("type") == "any"
    ):
        choices = list(named)
    elif isinstance(tool_choice, dict) and isinstance(
        (tool_choice.get("function") or tool_choice).get("name"), str
    ):
        name = (tool_choice.get("function") or tool_choice)["name"]
        if name not in named:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        choices = [name]
    else:
        raise ValueError(f"tool_choice {tool_choice!r}: use auto, none, required or a named tool")
    if not choices:
        raise ValueError("tool_choice forces a tool call, but the request has no tools")
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": closed_objects(named[n])},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n in choices
        ],
        "x-guidance": JSON_OPTIONS,
    }
    added = tokenizer.get_added_vocab() if tokenizer is not None else {}
    one = f"{_lark_text(begin, added)} %json {json.dumps(call)} {_lark_text(end, added)}"
    start = f"call ({_lark_text(separator, added)} call)*" if parallel else "call"
    return "ebnf", f"start: {start}\ncall: {one}\n"


def _lark_text(text: str, added: dict[str, int]) -> str:
    """Lark items matching `text`: its added tokens by id (<[id]>), the rest as string literals."""
    if not text:
        return ""
    if not added:
        return json.dumps(text)
    pattern = "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
    parts = re.split(pattern, text)
    return " ".join(f"<[{added[p]}]>" if p in added else json.dumps(p) for p in parts if p)
