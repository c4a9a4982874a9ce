"""The native model files over a paged KV cache (models/attention_batch.py) against their static
cache, which the HF forward checks (test_native*.py): sequences in shuffled pages of a shared
pool, prompts read in chunks packed with other sequences' decode tokens, then decode rows
through their page tables (SDPA on CPU; the decode kernel under Triton's interpreter), for
GQA (qwen3_moe) and MLA (deepseek_v3)."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.loader.load import load_model
from moetier.models import layers
from moetier.models.attention_batch import AttentionBatch

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
PAGE = 4


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "glm_moe_dsa"])
def native(request, tiny):
    return load_model(tiny.store(request.param), FP32)


def reference_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Every position's logits from one prefill over the static cache -> [L, V]."""
    cache = loaded.model.new_cache(1, 64, torch.float32, "cpu")
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]


def packed_logits(loaded, cache, spans, seqs) -> list[torch.Tensor]:
    """One packed forward of spans (seq index, start, count) -> each span's logits [count, V]."""
    batch = AttentionBatch.packed(
        [(start, count, seqs[s]["pages"]) for s, start, count in spans], PAGE, "cpu"
    )
    ids = torch.tensor([[t for s, start, count in spans for t in seqs[s]["ids"][start:][:count]]])
    with torch.inference_mode():
        logits = loaded.model(ids, batch.positions, cache, batch=batch)[0]
    return list(logits.split([count for _, _, count in spans]))


def test_packed_chunks_and_paged_decode_equal_the_static_cache(native, monkeypatch):
    vocab = native.model_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    lengths = [13, 6, 9]
    seqs = [{"ids": torch.randint(1, vocab, (n,), generator=gen).tolist()} for n in lengths]
    order = torch.randperm(24, generator=gen).tolist()  # pages of the pool, shuffled
    for i, seq in enumerate(seqs):
        seq["pages"] = order[i * 4 : (i + 1) * 4]  # 4 pages of 4: up to 16 positions
    cache = native.model.new_cache(24, PAGE, torch.float32, "cpu")
    # step 1: seq 0's first 5 tokens, seq 1's whole prompt of 4
    # step 2: seq 0's next 6 (crossing pages), seq 1's decode of token 4, seq 2's first 7
    # step 3: seq 0's last 2, seq 1's token 5, seq 2's last 2
    steps = [
        [(0, 0, 5), (1, 0, 4)],
        [(0, 5, 6), (1, 4, 1), (2, 0, 7)],
        [(0, 11, 2), (1, 5, 1), (2, 7, 2)],
    ]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    for spans in steps:
        for (s, _, _), logits in zip(spans, packed_logits(native, cache, spans, seqs), strict=True):
            got[s].append(logits)
    for s, seq in enumerate(seqs):
        want = reference_logits(native, seq["ids"])
        assert (torch.cat(got[s]) - want).abs().max().item() <= 1e-5, s

    # then decode rows, one token each, through the page tables: SDPA over gathered pages, and
    # (GQA) the decode kernel
    extra = torch.randint(1, vocab, (3, 2), generator=gen)
    table = torch.tensor([seq["pages"] for seq in seqs], dtype=torch.int32)
    kernel = isinstance(native.model.model.layers[0].self_attn, layers.Attention)
    modes = [True, False] if kernel else [True]
    for with_keys in modes:
        if not with_keys:  # the decode kernel (interpreted) reading the pages itself
            monkeypatch.setattr(layers, "_decode_kernel_applies", lambda x, tokens: tokens == 1)
        rows = [list(seq["ids"]) for seq in seqs]
        work = cache.clone()
        for step in range(2):
            positions = torch.tensor([[len(r)] for r in rows])
            batch = AttentionBatch.decode(positions, table, PAGE, with_keys=with_keys)
            with torch.inference_mode():
                logits = native.model(extra[:, step : step + 1], positions, work, batch=batch)
            for b, row in enumerate(rows):
                row.append(int(extra[b, step]))
                want = reference_logits(native, row)[-1]
                assert (logits[b, 0] - want).abs().max().item() <= 1e-5, (with_keys, step, b)


def test_packed_rejects_too_few_pages():
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionBatch.packed([(0, 9, [0, 1])], PAGE, "cpu")


def test_tokens_see_only_their_own_sequence():
    batch = AttentionBatch.packed([(0, 2, [5]), (3, 1, [2])], PAGE, "cpu")
    assert batch.positions.tolist() == [[0, 1, 3]]
    assert batch.write_page.tolist() == [[5, 5, 2]] and batch.write_offset.tolist() == [[0, 1, 3]]
    assert batch.key_page.tolist() == [[5, 5, 2, 2, 2, 2]]
    assert batch.mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1],
    ]
