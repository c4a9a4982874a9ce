"""`/v1/chat/completions`' sampling fields with the official `openai` client on a real uvicorn
over a float32 tiny model (the native model over paged KV): logprobs and top_logprobs against
log_softmax of the HF transformers forward, n sequences (seeded, streamed and not), presence
penalty and logit_bias against greedy decoding of the HF logits with the formula applied."""

from __future__ import annotations

import openai
import pytest
import torch
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine
from moetier.engine.prompts import chat_prompt_ids
from moetier.loader.load import load_model
from moetier.server.app import create_app

MODEL = "tiny-qwen3"
MESSAGES = [{"role": "user", "content": "Count the ducks on the pond, please."}]


@pytest.fixture(scope="module")
def fp32(tiny):
    """(client, tokenizer, HF model, the chat prompt's ids, the end ids)."""
    from transformers import AutoModelForCausalLM

    config = EngineConfig(device="cpu", dtype="float32")
    loaded = load_model(tiny.store("qwen3_moe"), config)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3_moe"), dtype=torch.float32, experts_implementation="eager"
    ).eval()
    engine = Engine(loaded)
    prompt = chat_prompt_ids(loaded.tokenizer, MESSAGES)
    ends = engine.chat_end_ids
    with serving(create_app(AsyncEngine(engine), MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        yield client, loaded.tokenizer, hf, prompt, ends


def hf_greedy(hf, prompt: list[int], steps: int, ends, adjust=lambda row, out: row):
    """Greedy tokens from the HF logits (each row through `adjust(row, output so far)`), up to
    an end token (not included); -> (tokens, the raw log_softmax row of each)."""
    ids, out, rows = list(prompt), [], []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        token = int(adjust(logits.clone(), out).argmax())
        if token in ends:
            break
        out.append(token)
        rows.append(torch.log_softmax(logits, dim=-1))
        ids.append(token)
    return out, rows


def test_logprobs_match_the_hf_forward(fp32):
    client, tokenizer, hf, prompt, ends = fp32
    tokens, rows = hf_greedy(hf, prompt, 6, ends)
    assert tokens  # the fixed tiny model answers something here
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True)
    resp = client.chat.completions.create(**kwargs, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in tokens]
    for entry, token, row in zip(content, tokens, rows, strict=True):
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        if "\ufffd" not in entry.token:  # (a whole character's token; see below for a byte's)
            assert entry.bytes == list(entry.token.encode())
        top = torch.topk(row, 3)
        assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.indices]
        for alt, value in zip(entry.top_logprobs, top.values.tolist(), strict=True):
            assert alt.logprob == pytest.approx(value, abs=1e-4)
    # a token here is one byte of a multi-byte character: its bytes are its own, and all of
    # them together are the answer's UTF-8
    assert any(e.token == "\ufffd" for e in content)
    joined = bytes(b for e in content for b in e.bytes)
    assert joined.decode("utf-8", "replace") == tokenizer.decode(tokens)
    streamed = [
        e
        for chunk in client.chat.completions.create(**kwargs, top_logprobs=3, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for e in choice.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    # (the second request reads the prompt's pages from the prefix cache: float paths differ)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
    assert plain.choices[0].logprobs is None


def test_n_sequences_seeded_streamed_and_not(fp32):
    client = fp32[0]
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3)
    resp = client.chat.completions.create(**kwargs)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in resp.choices]
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    assert len(set(texts)) > 1  # each sequence draws its own tokens
    streamed = ["", "", ""]
    finished = set()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert streamed == texts and finished == {0, 1, 2}
    one = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7
    )
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert resp.usage.completion_tokens > one.usage.completion_tokens


def test_presence_penalty_and_logit_bias_follow_the_formulas(fp32):
    client, tokenizer, hf, prompt, ends = fp32

    def penalised(row, out):
        for token in set(out):
            row[token] -= 2.0  # OpenAI's presence penalty over the generated tokens
        return row

    tokens, _ = hf_greedy(hf, prompt, 6, ends, penalised)
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, presence_penalty=2.0
    )
    assert resp.choices[0].message.content == tokenizer.decode(tokens)
    forced = 100
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert resp.choices[0].message.content == tokenizer.decode([forced] * 4)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_bad_sampling_fields_are_400s_naming_them(fp32, fields, words):
    client = fp32[0]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **fields)
    assert words in err.value.message
