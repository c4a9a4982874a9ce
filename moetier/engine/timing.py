"""How fast one generation ran: its prefill (the prompt's forward up to the first new token on
the host: the time to first token) and its decode (every later token, one forward a step).

The Generator times each stream with a `TokenClock`; `moetier generate` prints the summary line
and `moetier bench` reports the same figures, so both count the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class GenerationTiming:
    """Figures of one generation of `rows` sequences decoded together. Token counts are summed
    over the rows; `steps` counts forwards that gave each row a token (the first is the
    prefill's)."""

    rows: int
    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def summary(self) -> str:
        """One line: token counts, prefill tok/s with the time to first token, decode tok/s."""
        rows = f" in {self.rows} rows" if self.rows > 1 else ""
        line = (
            f"{self.prompt_tokens} prompt tokens, {self.new_tokens} new tokens{rows}; "
            f"prefill {self.prefill_tok_s:.1f} tok/s (first token after "
            f"{self.prefill_seconds * 1e3:.1f} ms)"
        )
        if self.decode_tokens == 0:
            return line + "; no decode step"
        return line + f", decode {self.decode_tok_s:.1f} tok/s"

    @property
    def decode_tokens(self) -> int:
        """Tokens of the decode steps: every new token but each row's first."""
        return max(0, self.new_tokens - self.rows)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else math.nan

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second over the decode steps, all rows together (NaN without any)."""
        if self.decode_tokens == 0 or self.decode_seconds <= 0:
            return math.nan
        return self.decode_tokens / self.decode_seconds


class TokenClock:
    """Times a generation as it runs: call `tokens_out` each time a step's tokens (one per row)
    are on the host. The prefill ends at the first call; the decode runs from there to the last
    (including whatever the caller does between steps: streaming text out is part of it)."""

    def __init__(self, rows: int, prompt_tokens: int) -> None:
        self.timing = GenerationTiming(rows, prompt_tokens)
        self._start = time.perf_counter()

    def tokens_out(self) -> None:
        now = time.perf_counter()
        timing = self.timing
        if timing.steps == 0:
            timing.prefill_seconds = now - self._start
        else:
            timing.decode_seconds = now - self._start - timing.prefill_seconds
        timing.steps += 1
        timing.new_tokens += timing.rows
