"""The streaming detokenizer keeps the special tokens a parser reads when asked (harmony's
`<|channel|>`, Kimi's section markers) and hides the end-of-sequence ones; by default it leaves
all special tokens out, as before."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moetier.engine.detokenizer import StreamingDetokenizer

SPECIALS = ["<|return|>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>"]
RAW = (
    "<|channel|>analysis<|message|>Need the weather in São Paulo.<|end|><|start|>assistant"
    "<|channel|>final<|message|>Sunny — 25 °C ✓<|return|>"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["analysis final assistant Need the weather in São Paulo sunny"], trainer
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|return|>", additional_special_tokens=SPECIALS[1:]
    )


def _stream(detok, ids):
    return "".join(detok.push(t)[0] for t in ids) + detok.flush()


def test_keeps_parser_markers_and_hides_end_ids(tokenizer):
    ids = tokenizer.encode(RAW, add_special_tokens=False)
    end = {tokenizer.convert_tokens_to_ids("<|return|>")}
    text = _stream(StreamingDetokenizer(tokenizer, (), keep_special=True, hidden=end), ids)
    assert text == RAW.removesuffix("<|return|>")


def test_default_drops_special_tokens_as_before(tokenizer):
    ids = tokenizer.encode(RAW, add_special_tokens=False)
    assert _stream(StreamingDetokenizer(tokenizer, ()), ids) == tokenizer.decode(
        ids, skip_special_tokens=True
    )
    assert "<|channel|>" not in tokenizer.decode(ids, skip_special_tokens=True)


def test_harmony_end_of_turn_is_return_or_call_not_end(tokenizer):
    """gpt-oss ends its reasoning message with <|end|>: that must not end the answer."""
    from types import SimpleNamespace

    from moetier.engine.detokenizer import end_token_ids

    vocab = tokenizer.get_vocab()
    loaded = SimpleNamespace(
        model_config=SimpleNamespace(eos_token_ids=(vocab["<|return|>"],)),
        model=SimpleNamespace(generation_config=None),
        tokenizer=tokenizer,
    )
    _, chat_end = end_token_ids(loaded)  # type: ignore[arg-type]
    assert vocab["<|end|>"] not in chat_end
    assert {vocab["<|return|>"], vocab["<|call|>"]} <= chat_end
