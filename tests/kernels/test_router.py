"""The softmax top-k router kernel against its twin (softmax + torch.topk)."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.router import router_topk, router_topk_ref

triton = pytest.importorskip("triton")
from moetier.kernels.router import router_topk_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renorm", "dtype"),
    [
        (3, 128, 8, True, torch.float32),
        (5, 60, 6, False, torch.bfloat16),  # neither E nor k a power of two
        (1, 32, 4, True, torch.float16),
        (2, 8, 8, True, torch.float32),  # k = E
    ],
)
def test_router_topk_matches_ref(tokens, experts, top_k, renorm, dtype):
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(dtype)
    ids, weights = router_topk_triton(logits.to(DEVICE), top_k, renorm)
    ref_ids, ref_w = router_topk_ref(logits, top_k, renorm)
    assert torch.equal(ids.cpu(), ref_ids)  # random logits: no ties
    torch.testing.assert_close(weights.cpu(), ref_w, rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lowest_index():
    logits = torch.zeros(1, 16)
    logits[0, 5] = logits[0, 9] = 2.0
    ids, weights = router_topk_triton(logits.to(DEVICE), 3, False)
    assert ids.cpu().tolist() == [[5, 9, 0]]
    assert weights[0, 0] == weights[0, 1] > weights[0, 2]


def test_op_cpu_path_and_fake():
    logits = torch.randn(4, 16)
    ids, weights = router_topk(logits, 2, True)
    ref_ids, ref_w = router_topk_ref(logits, 2, True)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    torch.library.opcheck(router_topk, (logits, 2, True))
