"""The dense GEMV kernel against F.linear."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.gemv import linear, linear_ref

triton = pytest.importorskip("triton")
from moetier.kernels.gemv import linear_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("tokens", "n", "k", "bias", "dtype"),
    [
        (1, 48, 96, False, torch.float32),
        (3, 130, 72, True, torch.float32),  # odd N, K not a multiple of the tile
        (8, 64, 256, False, torch.bfloat16),
        (2, 2048, 64, True, torch.float16),  # the 32-row tile
    ],
)
def test_gemv_matches_linear(tokens, n, k, bias, dtype):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = linear_triton(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if b is not None else None)
    want = linear_ref(x.float(), w.float(), b.float() if b is not None else None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol * k**0.5)


def test_op_cpu_path_and_fake():
    x, w = torch.randn(2, 3, 16), torch.randn(5, 16)
    assert torch.equal(linear(x, w, None), torch.nn.functional.linear(x, w))
    torch.library.opcheck(linear, (x, w, None))
