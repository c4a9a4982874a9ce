"""Tools a provider's own models have and a local model has not (OpenAI's hosted `web_search`,
Anthropic's versioned `web_search_20250305`, `bash_20250124`, ...): they come without a schema
and no call to them can reach the client, so the API modules leave them out of the prompt
instead of refusing the request (a client such as Codex or Claude Code may offer one beside its
own tools), and say so once per tool type in the log."""

from __future__ import annotations

import logging

log = logging.getLogger("moetier.server")
_said: set[str] = set()
SAID_AT_MOST = 64  # tool types named in the log (types come from clients: a bounded set)


def leave_out(kind: str, owner: str) -> None:
    """Note that a tool of type `kind`, one of `owner`'s own (OpenAI, Anthropic), is left out
    of the prompt: a warning the first time this process meets the type, nothing after (nor
    for new types once SAID_AT_MOST have been named)."""
    if kind in _said or len(_said) >= SAID_AT_MOST:
        return
    _said.add(kind)
    log.warning("tools: %r is one of %s's own tools, not one this model has: left out", kind, owner)
