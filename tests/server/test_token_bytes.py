"""`token_bytes`, the `bytes` of a chat logprob entry: a token's own bytes, whole even where
they are part of a UTF-8 character (OpenAI's `bytes` exist to rebuild such characters), for a
byte-level BPE (eval-moe-70m's tokenizer, GPT-2 style as Qwen's), a SentencePiece
byte-fallback vocabulary (`<0xHH>` tokens) and any other (the decoded text's UTF-8)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from moetier.server.openai import token_bytes

TEXTS = ["日本", "héllo wörld 🎉", " plain words", "<|im_end|>"]


@pytest.fixture(scope="module")
def byte_level(eval_model):
    return AutoTokenizer.from_pretrained(eval_model)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_give_back_the_texts_bytes(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(byte_level, t) for t in ids) == text.encode("utf-8")


def test_a_token_inside_a_character_is_its_byte_not_the_replacement_character(byte_level):
    ids = byte_level.encode("日本", add_special_tokens=False)
    assert len(ids) == 6  # this vocabulary spells each of the two characters' bytes apart
    assert byte_level.decode(ids[:1]) == "\ufffd"
    assert [token_bytes(byte_level, t) for t in ids[:3]] == [b"\xe6", b"\x97", b"\xa5"]


def sentencepiece_fallback() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE with byte fallback: pieces of ▁-joined words, and a `<0xHH>`
    token for each byte, for characters the vocabulary has no piece for."""
    vocab = {"<unk>": 0, "▁": 1, "h": 2, "i": 3, "hi": 4, "▁hi": 5, "é": 6}
    vocab.update({f"<0x{b:02X}>": 7 + b for b in range(256)})
    bpe = models.BPE(vocab, [("h", "i"), ("▁", "hi")], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_sentencepiece_byte_fallback_tokens_are_their_byte():
    tok = sentencepiece_fallback()
    ids = tok.encode("hi 日é", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert "<0xE6>" in pieces and "é" in pieces  # the case this test is about
    got = [token_bytes(tok, t) for t in ids]
    assert got[pieces.index("<0xE6>")] == b"\xe6"
    # "é" is a whole piece, not a byte-level byte (0xE9): its text's UTF-8
    assert got[pieces.index("é")] == "é".encode()
    assert b"".join(got) == " hi 日é".encode()  # (Metaspace: a ▁ before each word)
