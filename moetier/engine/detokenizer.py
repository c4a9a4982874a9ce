"""Token ids -> streamed text, and the token ids that end a generation.

`StreamingDetokenizer` hands out text as tokens arrive, holding back an incomplete UTF-8
character and a tail that could still grow into a stop string (stop strings are never emitted).
`end_token_ids` gives a model's end-of-sequence ids and, for chat, those plus the end-of-turn
tokens of common chat templates.
"""

from __future__ import annotations

from typing import Any

from moetier.loader.loaded_model import LoadedModel

# Tokens that end an assistant turn in common chat templates, added to the stop ids in chat mode.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|return|>", "<|endoftext|>")
HARMONY_CHANNEL = "<|channel|>"  # in a vocabulary: the harmony format


def end_token_ids(loaded: LoadedModel) -> tuple[set[int], set[int]]:
    """(end-of-sequence ids, chat end ids = those plus END_OF_TURN_TOKENS in the vocabulary):
    the config's, the generation config's and the tokenizer's eos ids."""
    ids = set(loaded.model_config.eos_token_ids)
    generation = getattr(loaded.model, "generation_config", None)
    gen_eos = getattr(generation, "eos_token_id", None)
    if gen_eos is not None:
        ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    vocab = loaded.tokenizer.get_vocab()
    turn_ends: tuple[str, ...] = END_OF_TURN_TOKENS
    if HARMONY_CHANNEL in vocab:
        # harmony (gpt-oss): <|end|> ends one message of the answer (its reasoning), not the
        # answer; <|call|> (a tool call) and <|return|> end it
        turn_ends = tuple(t for t in END_OF_TURN_TOKENS if t != "<|end|>") + ("<|call|>",)
    return ids, ids | {vocab[t] for t in turn_ends if t in vocab}


class StreamingDetokenizer:
    """Tokens -> text deltas; holds back incomplete UTF-8 and possible stop-string starts.

    Special tokens are left out of the text, unless `keep_special`: then only the `hidden` ids
    (the end-of-sequence and end-of-turn ids) are, and the markers a reasoning / tool-call parser
    reads (`<|channel|>`, `<|tool_calls_section_begin|>`, ...) stay in the text.

    Incremental: each token decodes a short window (the ids from the last confirmed piece on)
    and its text beyond the window's confirmed part is appended, so a token costs the same at
    the thousandth token as at the first (decoding the whole output each time cost O(n) a token:
    milliseconds a step at 64 streams). Decoding from a window's start keeps the tokenizer's own
    spacing, as transformers' TextStreamer does over its cache.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: tuple[str, ...],
        keep_special: bool = False,
        hidden: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.keep_special = keep_special
        self.hidden = frozenset(hidden)
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []  # the tokens that reach the text (hidden ones left out)
        self.text = ""  # the text of ids[: self.read], whole characters
        self.window = 0  # ids[window : read] decode to the last confirmed piece's context
        self.read = 0
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._backend = _plain_backend(tokenizer)

    def push(self, token: int) -> tuple[str, bool]:
        if not (self.keep_special and token in self.hidden):
            self.ids.append(token)
        piece = self._pending()
        if piece.endswith("\ufffd"):
            return "", False  # a multi-byte character is not complete yet
        if piece:
            self.text += piece
            self.window, self.read = self.read, len(self.ids)
        text = self.text
        pending = text[self.emitted :]
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.stopped = True
                self.matched = s
                out = text[self.emitted : at]
                self.emitted = len(text)
                return out, True
        # Keep back a tail that could still grow into a stop string.
        hold = max((_overlap(pending, s) for s in self.stop), default=0)
        out = pending[: len(pending) - hold]
        self.emitted += len(out)
        return out, False

    def _decode(self, ids: list[int]) -> str:
        skip = not self.keep_special
        if self._backend is not None:  # what tokenizer.decode returns, without its wrapping
            return str(self._backend.decode(ids, skip_special_tokens=skip))
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip))

    def _pending(self) -> str:
        """The text the ids after `read` add to `text` (may end in an incomplete character)."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.window : self.read])
        after = self._decode(self.ids[self.window :])
        if not after.startswith(before):  # the tokenizer respelled the window: take it whole
            return self._decode(self.ids)[len(self.text) :]
        return after[len(before) :]

    def flush(self) -> str:
        piece = self._pending()
        self.text += piece
        self.window = self.read = len(self.ids)
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def _plain_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` whose decode is exactly the tokenizer's (a transformers fast
    tokenizer that neither cleans up spaces nor overrides `_decode`), else None. Two decodes a
    token through transformers' wrapping (input conversion, argument handling) cost tens of
    microseconds a step: a tenth of a batch-1 decode step on the GPU."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend) or tokenizer.clean_up_tokenization_spaces:
        return None
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return getattr(tokenizer, "_tokenizer", None)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
