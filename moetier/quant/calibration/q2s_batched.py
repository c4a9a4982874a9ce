"""q2s over a batch of experts at once, on any device (quant/q2s.py's algorithm, batched).

One call quantises the same matrix of E experts, w [E, N, K], in torch on w's device: the
GPU when there is one, all CPU cores otherwise. Three roundings:
  nearest  no statistics: MSE group-scale search, round to nearest (== quantize_q2s(w, None))
  diag     importance per input channel d [E, K] (llama.cpp's imatrix, mean x^2): group scales
           searched and refitted under sum_k d_k (w_k - w_hat_k)^2, codes nearest
           (== quantize_q2s(w, diag(d)), whose Hessian has no off-diagonal to feed errors on)
  gptq     Hessians h [E, K, K]: GPTQ error feedback, column by column, every expert's rows in
           one step (== quantize_q2s(w, h), up to float summation order)
Codes, scales and row scales come back in quant/q2s.py's stored form ([E, ...] each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.quant.q2s import E4M3_MAX, GROUP_SCALE_TOP, _nearest_codes, pack_codes

GRID = (0.5, 1.5)


@dataclass
class BatchedQ2S:
    codes: torch.Tensor  # [E, N, K] uint8, 0..3
    scales: torch.Tensor  # [E, N, K // g] float8_e4m3fn
    row_scale: torch.Tensor  # [E, N] float32
    grid: tuple[float, float]
    group: int

    def parts(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e's stored parts (core/layout.MatrixCodec names), on the CPU."""
        return {
            "codes": pack_codes(self.codes[e]).cpu(),
            "scales": self.scales[e].cpu(),
            "row_scale": self.row_scale[e].cpu(),
            "grid": torch.tensor(self.grid, dtype=torch.float32),
        }

    def dequantize(self) -> torch.Tensor:
        """[E, N, K] float32, as the kernels decode it."""
        a, b = self.grid
        levels = torch.tensor([-b, -a, a, b], device=self.codes.device)
        group_scale = self.scales.float().repeat_interleave(self.group, dim=-1)
        return self.row_scale[..., None] * group_scale * levels[self.codes.long()]


def _values(codes: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Codes 0..3 -> (-b, -a, a, b), by arithmetic (a table lookup is slow on the CPU)."""
    outer = (codes == 0) | (codes == 3)
    return torch.where(codes >= 2, 1.0, -1.0) * torch.where(outer, b, a)


def _rounded(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """x in units of the scale -> the value of its nearest level (_nearest_codes, decoded)."""
    return torch.where(x >= 0, 1.0, -1.0) * torch.where(x.abs() > (a + b) / 2, b, a)


def _stored(s: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    rel = (s / row_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    return rel * row_scale


def _search(
    w: torch.Tensor, imp: torch.Tensor | None, a: float, b: float, row_scale: torch.Tensor
) -> torch.Tensor:
    """Stored group scale per row minimising sum imp (w - s q(w/s))^2 (quant/q2s._search_scale,
    the same values: w - sign(w) m s = sign(w) (|w| - m s) exactly, so the error is computed on
    |w| with fewer passes). w [..., g], imp broadcastable to w (None: ones), row_scale [...]."""
    absw = w.abs()
    amax = absw.amax(dim=-1).clamp_min(1e-12)
    best_err = torch.full_like(amax, float("inf"))
    best = _stored(amax / b, row_scale)
    threshold = (a + b) / 2
    for f in torch.linspace(0.45, 1.25, 32).tolist():
        s = _stored(amax * f / b, row_scale).clamp_min(1e-30)[..., None]
        mag = torch.where(absw / s > threshold, b, a)
        diff = absw - mag * s
        sq = diff * diff if imp is None else diff * diff * imp
        err = sq.sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s[..., 0], best)
    return best


def _row_scale(w: torch.Tensor, b: float) -> torch.Tensor:
    return (w.abs().amax(dim=-1) * 1.25 / b / GROUP_SCALE_TOP).clamp_min(1e-30)


def quantize_q2s_batched(
    w: torch.Tensor,
    hessian: torch.Tensor | None = None,
    importance: torch.Tensor | None = None,
    group: int = 32,
    damp: float = 0.01,
    block: int = 128,
    refine: int = 0,
) -> BatchedQ2S:
    """w [E, N, K]; `hessian` [E, K, K] (gptq) or `importance` [E, K] (diag) or neither
    (nearest). Runs on w's device; statistics are moved there."""
    if w.dim() != 3 or w.shape[2] % group:
        raise ValueError(f"q2s needs [E, N, K] with K divisible by {group}, got {tuple(w.shape)}")
    if hessian is not None and importance is not None:
        raise ValueError("give a Hessian (gptq) or an importance vector (diag), not both")
    a, b = GRID
    w = w.float()
    e_, n, k = w.shape
    gs = k // group
    row_scale = _row_scale(w, b)  # [E, N]
    if hessian is None:
        imp = None
        if importance is not None:
            d = importance.to(w.device).float()
            dead = d <= 0
            w = w.masked_fill(dead[:, None, :], 0.0)
            imp = torch.where(dead, 1.0, d).clamp_min(1e-12).view(e_, 1, gs, group)
        groups = w.view(e_, n, gs, group)
        raw = _search(groups, imp, a, b, row_scale[..., None].expand(e_, n, gs))  # [E, N, G]
        codes = _nearest_codes(w / raw.repeat_interleave(group, dim=-1), a, b)
        if importance is not None:
            raw = _refit_diag(groups, d, codes.view(e_, n, gs, group), raw, row_scale, a, b)
        scales = (raw / row_scale[..., None]).to(torch.float8_e4m3fn)
        return BatchedQ2S(codes, scales, row_scale, GRID, group)
    return _gptq(w, hessian.to(w.device), row_scale, group, damp, block, refine)


def _refit_diag(
    groups: torch.Tensor,
    d: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    row_scale: torch.Tensor,
    a: float,
    b: float,
) -> torch.Tensor:
    """quant/q2s._refit_scales for a diagonal Hessian: each group's least-squares scale on its
    own (the G x G system is diagonal), E4M3-rounded, kept per row only where it lowers the
    row's error. groups, codes [E, N, G, g]; d [E, K] (raw: dead channels weigh 0)."""
    e_, n, gs, g = groups.shape
    dg = d.view(e_, 1, gs, g)
    v = _values(codes, a, b)
    lhs = (v * v * dg).sum(-1)  # [E, N, G]
    rhs = (v * groups * dg).sum(-1)
    ridge = 1e-6 * lhs.mean(-1, keepdim=True).clamp_min(1e-30)
    solved = rhs / (lhs + ridge)
    solved = torch.where(solved.isfinite(), solved, scales).clamp_min(1e-30)
    solved = _stored(solved, row_scale[..., None])

    def objective(sc: torch.Tensor) -> torch.Tensor:
        return (((groups - v * sc[..., None]) ** 2) * dg).sum(dim=(-1, -2))  # [E, N]

    return torch.where((objective(solved) < objective(scales))[..., None], solved, scales)


def _gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    row_scale: torch.Tensor,
    group: int,
    damp: float,
    block: int,
    refine: int = 0,
) -> BatchedQ2S:
    a, b = GRID
    e_, n, k = w.shape
    w_orig = w.clone()
    w = w.clone()
    dev = w.device
    # float64 factorisation as quant/q2s.py does (CPU and CUDA both support it)
    h = hessian.double().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    dead = diag <= 0  # [E, K]
    diag.copy_(torch.where(dead, 1.0, diag))
    w.masked_fill_(dead[:, None, :], 0.0)
    imp = h.diagonal(dim1=-2, dim2=-1).float().clamp_min(1e-12)  # [E, K]
    eye = torch.eye(k, dtype=h.dtype, device=dev)
    h += damp * h.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * eye
    hinv = torch.linalg.cholesky(
        torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True
    ).float()  # [E, K, K]
    del h
    hf = hessian.float()
    raw = torch.zeros(e_, n, k // group, device=dev)
    codes = _gptq_pass(w, hinv, raw, row_scale, group, block, imp, static=False)
    raw = _refit(w_orig, hf, codes, raw, row_scale, a, b, group)
    best = _objective(w_orig, hf, codes, raw, a, b, group) if refine else None
    for _ in range(refine):
        assert best is not None
        # codes again by GPTQ with the refitted scales held, then the scales refitted to them;
        # each row keeps whichever pair gives the smaller output error
        c2 = _gptq_pass(w, hinv, raw.clone(), row_scale, group, block, imp, static=True)
        r2 = _refit(w_orig, hf, c2, raw, row_scale, a, b, group)
        err = _objective(w_orig, hf, c2, r2, a, b, group)
        better = err < best
        codes = torch.where(better[..., None], c2, codes)
        raw = torch.where(better[..., None], r2, raw)
        best = torch.where(better, err, best)
    scales = (raw / row_scale[..., None]).to(torch.float8_e4m3fn)
    return BatchedQ2S(codes, scales, row_scale, GRID, group)


def _objective(
    w: torch.Tensor, h: torch.Tensor, codes: torch.Tensor, raw: torch.Tensor,
    a: float, b: float, group: int,
) -> torch.Tensor:  # fmt: skip
    """Per row tr((W - W_hat) H (W - W_hat)^T): [E, N]."""
    d = w - _values(codes, a, b) * raw.repeat_interleave(group, dim=-1)
    return (torch.bmm(d, h) * d).sum(dim=-1)


def _gptq_pass(
    w: torch.Tensor,
    hinv: torch.Tensor,
    raw: torch.Tensor,
    row_scale: torch.Tensor,
    group: int,
    block: int,
    imp: torch.Tensor,
    static: bool,
) -> torch.Tensor:
    """GPTQ's column loop: codes [E, N, K]. `hinv` is the upper Cholesky factor of H^-1.
    static: the group scales `raw` [E, N, G] are held; otherwise each group's scale is
    searched on the error-updated weights when the loop reaches it and written into `raw`."""
    a, b = GRID
    e_, n, k = w.shape
    w = w.clone()
    codes = torch.zeros(e_, n, k, dtype=torch.uint8, device=w.device)
    for b0 in range(0, k, block):
        b1 = min(k, b0 + block)
        wb = w[:, :, b0:b1].clone()
        err = torch.zeros_like(wb)
        for j in range(b1 - b0):
            col = b0 + j
            if not static and col % group == 0:
                end = col + group
                cur = (
                    wb[:, :, j : j + group]
                    if end <= b1
                    else torch.cat([wb[:, :, j:], w[:, :, b1:end]], dim=-1)
                )
                raw[:, :, col // group] = _search(cur, imp[:, None, col:end], a, b, row_scale)
            s = raw[:, :, col // group]
            c = _nearest_codes(wb[:, :, j] / s, a, b)
            codes[:, :, col] = c
            q = _values(c, a, b) * s
            e = (wb[:, :, j] - q) / hinv[:, col, col][:, None]  # [E, N]
            wb[:, :, j + 1 :] -= e[:, :, None] * hinv[:, None, col, col + 1 : b1]
            err[:, :, j] = e
        w[:, :, b0:b1] = wb
        if b1 < k:
            w[:, :, b1:] -= torch.bmm(err, hinv[:, b0:b1, b1:])
    return codes


def _refit(
    w: torch.Tensor,
    h: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    row_scale: torch.Tensor,
    a: float,
    b: float,
    group: int,
    block_bytes: int = 2**30,
) -> torch.Tensor:
    """quant/q2s._refit_scales per expert: with the codes fixed, the group scales minimising
    tr((W - W_hat) H (W - W_hat)^T), per row a G x G solve, E4M3-rounded, kept where better.
    Rows go in blocks so the [E, rows, G, K] intermediate stays under `block_bytes`."""
    e_, n, k = w.shape
    gs = k // group
    hb = h.view(e_, gs, group, gs, group)
    eye = torch.eye(gs, device=w.device)
    rows = max(1, block_bytes // (4 * e_ * gs * k))
    out = torch.empty_like(scales)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        v = _values(codes[:, r0:r1], a, b).view(e_, r1 - r0, gs, group)
        wr = w[:, r0:r1]
        lhs = torch.einsum("enai,eaibj,enbj->enab", v, hb, v)  # [E, r, G, G]
        rhs = torch.einsum("enai,enai->ena", v, torch.bmm(wr, h).view(e_, r1 - r0, gs, group))
        ridge = 1e-6 * lhs.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
        solved, info = torch.linalg.solve_ex(lhs + ridge[..., None, None] * eye, rhs)
        del lhs
        old = scales[:, r0:r1]
        ok = (info == 0)[..., None] & solved.isfinite()
        solved = _stored(torch.where(ok, solved, old).clamp_min(1e-30), row_scale[:, r0:r1, None])

        def objective(sc: torch.Tensor, v: torch.Tensor = v, wr: torch.Tensor = wr) -> torch.Tensor:
            d = wr - (v * sc[..., None]).view(wr.shape)
            return (torch.bmm(d, h) * d).sum(dim=-1)  # [E, r]

        better = (objective(solved) < objective(old))[..., None]
        out[:, r0:r1] = torch.where(better, solved, old)
    return out
