"""Tool-call arguments written one parameter at a time (Qwen3-Coder, GLM, MiniMax, DSML), as JSON.

XML-style formats carry no types: `<parameter=n>10</parameter>` may mean 10 or "10". `XmlArgs`
writes the JSON object as the parameters arrive, typing each value by the request's tool schema:
a parameter the schema says is a string streams as a JSON string while it is generated; any other
is held until its end and converted (integer, number, boolean, null, object, array); a value that
does not convert, a parameter the schema does not describe, and one whose schema allows a string
and something else are kept as strings (the ambiguous case). Formats that mark raw JSON values
(DSML's `string="false"`) pass `raw=True`.
"""

from __future__ import annotations

import ast
import json
from typing import Any


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def schema_types(schema: dict[str, Any] | None) -> set[str]:
    """The JSON types a property's schema allows (empty: unknown)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            types |= schema_types(member)
    if "enum" in schema and not types:
        types = {_json_type(v) for v in schema["enum"]}
    if "properties" in schema and not types:
        types = {"object"}
    return types


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _load(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        pass
    try:  # Qwen3-Coder's template writes non-string values with Python's str()
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False, None


def coerce(text: str, types: set[str]) -> Any:
    """`text` as the value of a parameter of `types`; the text itself where that fails or the
    types are unknown or allow a string."""
    if not types or "string" in types:
        return text
    value = text.strip()
    for kind in sorted(types, key=_order):
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                try:
                    as_float = float(value)
                except ValueError:
                    continue
                if as_float.is_integer():
                    return int(as_float)
        elif kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            integral = number.is_integer() and not any(c in value for c in ".eE")
            return int(number) if integral else number
        elif kind == "boolean":
            if value.lower() in ("true", "false"):
                return value.lower() == "true"
        elif kind == "null":
            if value.lower() in ("null", "none"):
                return None
        elif kind in ("array", "object"):
            ok, loaded = _load(value)
            if ok and isinstance(loaded, list if kind == "array" else dict):
                return loaded
    return text


def _order(kind: str) -> int:
    order = ["integer", "number", "boolean", "null", "array", "object"]
    return order.index(kind) if kind in order else len(order)


class XmlArgs:
    """Builds one call's JSON arguments from parameters: begin, value chunks, end, close."""

    def __init__(self, schema: dict[str, Any] | None) -> None:
        props = (schema or {}).get("properties") if isinstance(schema, dict) else None
        self.props: dict[str, Any] = props if isinstance(props, dict) else {}
        self.count = 0
        self.key = ""
        self.streaming = False
        self.raw = False
        self.value = ""

    def begin(self, key: str, raw: bool | None = None) -> str:
        """A parameter starts; raw: True for a value marked as JSON, False for one marked as a
        string, None when the format does not say."""
        self.key, self.value, self.raw = key, "", bool(raw)
        types = schema_types(self.props.get(key))
        self.streaming = raw is False or (raw is None and types == {"string"})
        self.types = types
        if self.streaming:
            return self._key() + '"'
        return ""

    def chunk(self, text: str) -> str:
        if self.streaming:
            return dumps(text)[1:-1]
        self.value += text
        return ""

    def end(self) -> str:
        if self.streaming:
            return '"'
        if self.raw:
            ok, loaded = _load(self.value.strip())
            value = loaded if ok else coerce(self.value, self.types)
        else:
            value = coerce(self.value, self.types)
        return self._key() + dumps(value)

    def close(self) -> str:
        return "{}" if self.count == 0 else "}"

    def _key(self) -> str:
        sep = "{" if self.count == 0 else ", "
        self.count += 1
        return sep + dumps(self.key) + ": "
