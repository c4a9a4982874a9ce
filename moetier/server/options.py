"""The HTTP side's settings: keys, model-name aliases, CORS origins and the request limits; each
field is a flag of `moetier serve` (docs/serving.md lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerOptions:
    api_key: tuple[str, ...] = field(
        default=(),
        metadata={"help": "a key clients must send as `Authorization: Bearer KEY` or "
                  "`x-api-key: KEY` (repeatable; also $MOETIER_API_KEY, comma-separated)"},
    )  # fmt: skip
    served_model_name: tuple[str, ...] = field(
        default=(),
        metadata={"help": "another model name requests may use (repeatable; `*` and `?` make "
                  "a pattern, e.g. 'claude-*' for Claude Code)"},
    )  # fmt: skip
    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata={"help": "browser origins allowed by CORS (repeatable; `*` for any; none: CORS "
                  "off)"},
    )  # fmt: skip
    max_body_mb: float = field(
        default=64.0, metadata={"help": "the largest request body in MiB (413 above it)"}
    )
    max_queued_requests: int = field(
        default=256,
        metadata={"help": "requests that may wait beyond --max-num-seqs (429 above it)"},
    )
    max_request_tokens: int = field(
        default=1 << 20,
        metadata={"help": "the most tokens one request may ask for, n x max_tokens (400 above)"},
    )
    keep_alive_s: float = field(
        default=5.0,
        metadata={"help": "seconds a silent stream waits before an SSE `: keep-alive` comment"},
    )

    tool_parser: str = field(
        default="",
        metadata={"help": "the reasoning and tool-call parser family (default: chosen from the "
                  "chat template and model_type; 'none': plain text; docs/serving.md)"},
    )  # fmt: skip
    default_chat_template_kwargs: str = field(
        default="",
        metadata={"help": "chat template variables as a JSON object, e.g. "
                  "'{\"enable_thinking\": false}'; a request's chat_template_kwargs win"},
    )  # fmt: skip
    reasoning_field: str = field(
        default="reasoning_content",
        metadata={"help": "where OpenAI chat answers put the reasoning: reasoning_content "
                  "(DeepSeek, SGLang, llama.cpp), reasoning (vLLM, OpenRouter) or both"},
    )  # fmt: skip
    relaxed_chat_template: bool = field(
        default=False,
        metadata={"help": "a conversation the chat template refuses is tried once more with its "
                  "system messages joined into one at the front (else: a 400 with the "
                  "template's message)"},
    )  # fmt: skip
    reasoning_parser: str = field(
        default="",
        metadata={"help": "the same choice by its other name: one parser reads reasoning and "
                  "tool calls together, so it must agree with --tool-parser"},
    )  # fmt: skip

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))
