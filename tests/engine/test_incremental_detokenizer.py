"""The incremental streaming detokenizer against the tokenizer's own decode of the whole output:
token by token, the joined deltas (and the flush) are exactly the whole text, for real text with
multi-byte characters and for random token ids (byte fragments, special tokens)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from moetier.config import DEFAULT_STORE
from moetier.engine.detokenizer import StreamingDetokenizer

TEXT = (
    "Café au lait — naïve façade; 東京タワーは高い。 Emoji: 🚀🧪 and spaces   here.\n"
    "def f(x):\n    return x ** 2  # ünïcödé\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_STORE)


def streamed(tokenizer, ids, **kwargs) -> str:
    detok = StreamingDetokenizer(tokenizer, (), **kwargs)
    out = "".join(detok.push(t)[0] for t in ids)
    return out + detok.flush()


def test_real_text_streams_to_the_whole_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert streamed(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT


@pytest.mark.parametrize("seed", range(8))
def test_random_ids_stream_to_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    assert streamed(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)
    hidden = set(ids[::7])
    kept = [t for t in ids if t not in hidden]
    want = tokenizer.decode(kept, skip_special_tokens=False)
    assert streamed(tokenizer, ids, keep_special=True, hidden=hidden) == want


def test_the_rust_decode_is_taken_only_where_it_equals_transformers(tokenizer):
    """The tests above compare the streamed text with tokenizer.decode: through the tokenizers
    backend directly for this tokenizer; a tokenizer that cleans up spaces keeps decode."""
    assert StreamingDetokenizer(tokenizer, ())._backend is not None
    cleaning = AutoTokenizer.from_pretrained(DEFAULT_STORE, clean_up_tokenization_spaces=True)
    detok = StreamingDetokenizer(cleaning, ())
    assert detok._backend is None
    ids = cleaning.encode("a , b . c", add_special_tokens=False)
    assert streamed(cleaning, ids) == cleaning.decode(ids, skip_special_tokens=True)
