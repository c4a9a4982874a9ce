"""A reasoning budget (Anthropic's `thinking.budget_tokens`): a sequence may write at most
`budget` tokens before its end-of-reasoning marker (`</think>` as the tokenizer splits it); if
the marker has not come by then, it is forced, token by token, and the answer follows.
With `start_ids` (the start-of-reasoning marker, for a prompt that does not leave the model
inside reasoning: a hybrid model opens `<think>` itself when it thinks) the budget holds only for
an answer that opens with that marker; an answer that begins otherwise is not reasoning, and
nothing is forced into it.

`ReasoningBudget` has a grammar matcher's shape (engine/grammar.py), so the step sampler applies
it through the same hook: each step it fills a row of the allowed-token bitmask (every token, or
only the marker's next token) and is told the token drawn. It never ends the sequence itself.
"""

from __future__ import annotations

import torch


class ReasoningBudget:
    def __init__(
        self, budget: int, end_ids: tuple[int, ...], start_ids: tuple[int, ...] = ()
    ) -> None:
        if budget < 1 or not end_ids:
            raise ValueError("a reasoning budget needs at least 1 token and an end marker")
        self.budget = budget
        self.end_ids = tuple(end_ids)
        self.start_ids = tuple(start_ids)
        self.opened = 0  # tokens of start_ids the answer has begun with
        self.count = 0  # tokens accepted
        self.forced = -1  # index into end_ids being forced (-1: not forcing)
        self.closed = False  # the marker is out: no budget any more
        self._tail: list[int] = []  # the last len(end_ids) tokens

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        opening = self.opened < len(self.start_ids)
        if self.closed or opening or (self.forced < 0 and self.count < self.budget):
            row.fill_(-1)  # every bit set: any token
            return
        token = self.end_ids[max(self.forced, 0)]
        row.zero_()
        word, bit = divmod(token, 32)
        row[word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)

    def accept_token(self, token: int) -> bool:
        self.count += 1
        if self.closed:
            return True
        if self.forced >= 0:
            if token != self.end_ids[self.forced]:
                return False
            self.forced += 1
            if self.forced == len(self.end_ids):
                self.closed = True
            return True
        if self.opened < len(self.start_ids):  # the answer must open reasoning first
            if token != self.start_ids[self.opened]:
                self.closed = True  # it did not: an answer without reasoning has no budget
                return True
            self.opened += 1
            if self.opened == len(self.start_ids) and self.count >= self.budget:
                self.forced = 0
            return True
        self._tail = (self._tail + [token])[-len(self.end_ids) :]
        if tuple(self._tail) == self.end_ids:
            self.closed = True  # the model ended its reasoning itself
        elif self.count == self.budget:  # from the next token on, the rest of the marker
            self.forced = self._partial()
        return True

    def _partial(self) -> int:
        """How much of the marker the output already ends with (its first tokens, not all)."""
        for n in range(min(len(self._tail), len(self.end_ids) - 1), 0, -1):
            if tuple(self._tail[-n:]) == self.end_ids[:n]:
                return n
        return 0

    def is_terminated(self) -> bool:
        return False
