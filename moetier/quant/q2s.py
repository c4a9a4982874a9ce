"""q2s: 2-bit codes on a sign-symmetric grid {-b, -a, +a, +b} * s (research/quant.md §4.1).

One matrix W [N, K] (out, in) is stored as
  codes      [N, K]      uint8 in 0..3 (unpacked; `pack_codes` puts 4 per byte along K)
  scales     [N, K//g]   float8_e4m3fn, one per group of g weights along K
  row_scale  [N]         float32
  grid       [2]         float32 (a, b), fitted per matrix
and decodes as  W_hat[n, k] = row_scale[n] * scales[n, k // g] * LEVELS(a, b)[codes[n, k]]
with LEVELS = (-b, -a, +a, +b). Bits per weight: 2 + 8/g + 32/K (+ 64 bits per matrix).

Quantisation is GPTQ-style (error feedback through the inverse Hessian of the layer input,
H = sum x x^T from calibration activations), with each group's scale chosen by an
importance-weighted error search (importance = diag(H), llama.cpp's imatrix); without H it is
plain round-to-nearest with an MSE scale search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
# Row scale puts the largest group scale of a row here: E4M3 keeps 3 mantissa bits from 2^-6 up.
GROUP_SCALE_TOP = 256.0


@dataclass
class Q2S:
    codes: torch.Tensor  # [N, K] uint8
    scales: torch.Tensor  # [N, K // g] float8_e4m3fn
    row_scale: torch.Tensor  # [N] float32
    grid: torch.Tensor  # [2] float32: a, b
    group: int

    def levels(self) -> torch.Tensor:
        a, b = self.grid.tolist()
        return torch.tensor([-b, -a, a, b], dtype=torch.float32)

    def dequantize(self) -> torch.Tensor:
        group_scale = self.scales.float().repeat_interleave(self.group, dim=1)  # [N, K]
        return self.row_scale[:, None] * group_scale * self.levels()[self.codes.long()]

    @property
    def bits_per_weight(self) -> float:
        n, k = self.codes.shape
        return 2 + 8 / self.group + 32 / k + 64 / (n * k)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes (0..3) -> [N, K // 4] uint8; code j of a byte sits at bits 2j..2j+1,
    so 4 consecutive bytes read as a little-endian int32 hold 16 codes, code j at bits 2j."""
    c = codes.view(codes.shape[0], -1, 4).to(torch.uint8)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & 3).reshape(packed.shape[0], -1)


def _nearest_codes(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """x in units of the scale -> nearest of (-b, -a, a, b) as codes 0..3."""
    mag = (x.abs() > (a + b) / 2).to(torch.uint8)  # 1 = outer level b
    return torch.where(x >= 0, 2 + mag, 1 - mag)


def _level_values(codes: torch.Tensor, a: float, b: float) -> torch.Tensor:
    return torch.tensor([-b, -a, a, b], dtype=torch.float32)[codes.long()]


def _stored_scale(s: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The group scale as it will decode: row_scale * e4m3(s / row_scale)."""
    rel = (s / row_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    return rel * row_scale


def _search_scale(
    w: torch.Tensor, imp: torch.Tensor, a: float, b: float, row_scale: torch.Tensor, steps: int = 32
) -> torch.Tensor:
    """Per-row stored group scale minimising sum_k imp_k (w_k - s*q(w_k/s))^2. w: [N, g] -> [N]."""
    amax = w.abs().amax(dim=1).clamp_min(1e-12)  # [N]
    best_err = torch.full_like(amax, float("inf"))
    best = _stored_scale(amax / b, row_scale)
    for f in torch.linspace(0.45, 1.25, steps).tolist():
        s = _stored_scale(amax * f / b, row_scale).clamp_min(1e-30)  # [N]
        q = _level_values(_nearest_codes(w / s[:, None], a, b), a, b) * s[:, None]
        err = ((w - q) ** 2 * imp).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    return best


def quantize_q2s(
    w: torch.Tensor,
    hessian: torch.Tensor | None = None,
    group: int = 32,
    grid: tuple[float, float] = (0.5, 1.5),
    damp: float = 0.01,
    block: int = 128,
    refit_scales: bool = True,
    act_order: bool = False,
) -> Q2S:
    """Quantise W [N, K] (K divisible by `group`). `hessian` [K, K] = sum of x x^T over the
    calibration inputs of this matrix (None: round to nearest, unweighted scale search).

    act_order: visit columns by decreasing importance (GPTQ's act-order) with group scales fixed
    up front from the original weights (static groups); otherwise columns in order, each group's
    scale searched on the error-updated weights when the loop reaches it."""
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(
            f"q2s needs a 2-D matrix with K divisible by {group}, got {tuple(w.shape)}"
        )
    w = w.float().clone()
    w_orig = w.clone()
    n, k = w.shape
    a, b = grid
    # Row scale fixed up front so each group scale is rounded to its stored E4M3 value before
    # GPTQ uses it: the largest candidate scale of a row maps to GROUP_SCALE_TOP.
    row_scale = (w.abs().amax(dim=1) * 1.25 / b / GROUP_SCALE_TOP).clamp_min(1e-30)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    raw_scales = torch.zeros(n, k // group)
    if hessian is None:
        # Round to nearest: no error feedback, so every group at once (same result as the loop).
        groups = w.view(n * (k // group), group)  # [N*G, g]
        raw_scales = _search_scale(
            groups, torch.ones(group), a, b, row_scale.repeat_interleave(k // group)
        ).view(n, k // group)
        codes = _nearest_codes(w / raw_scales.repeat_interleave(group, dim=1), a, b)
        scales = (raw_scales / row_scale[:, None]).to(torch.float8_e4m3fn)
        return Q2S(codes, scales, row_scale, torch.tensor([a, b]), group)
    perm = torch.arange(k)
    h = hessian.double().clone()
    dead = torch.diag(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    imp = torch.diag(h).float().clamp_min(1e-12)
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    if act_order:
        for g in range(k // group):
            cols = slice(g * group, (g + 1) * group)
            raw_scales[:, g] = _search_scale(w[:, cols], imp[cols], a, b, row_scale)
        perm = torch.argsort(torch.diag(h), descending=True)
        h = h[perm][:, perm]
    # Upper Cholesky factor of H^-1: row j holds how column j's error spreads to columns > j.
    hinv = torch.linalg.cholesky(
        torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True
    ).float()
    static = act_order
    w = w[:, perm]  # work in visiting order; perm[j] is the original column of position j
    for b0 in range(0, k, block):
        b1 = min(k, b0 + block)
        wb = w[:, b0:b1].clone()
        err_block = torch.zeros_like(wb)
        for j in range(b1 - b0):
            col = b0 + j
            orig = int(perm[col])
            if not static and col % group == 0:
                current = w_slice(w, wb, b0, col, group)
                raw_scales[:, col // group] = _search_scale(
                    current, imp[col : col + group], a, b, row_scale
                )
            s = raw_scales[:, orig // group]
            c = _nearest_codes(wb[:, j] / s, a, b)
            codes[:, orig] = c
            q = _level_values(c, a, b) * s
            e = (wb[:, j] - q) / hinv[col, col]
            wb[:, j + 1 :] -= e[:, None] * hinv[col, col + 1 : b1][None, :]
            err_block[:, j] = e
        w[:, b0:b1] = wb
        if b1 < k:
            w[:, b1:] -= err_block @ hinv[b0:b1, b1:]

    if refit_scales:
        raw_scales = _refit_scales(
            w_orig, hessian.float(), codes, raw_scales, row_scale, a, b, group
        )
    scales = (raw_scales / row_scale[:, None]).to(torch.float8_e4m3fn)  # exact: already on the grid
    return Q2S(codes, scales, row_scale, torch.tensor([a, b]), group)


def _refit_scales(
    w: torch.Tensor,
    h: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    row_scale: torch.Tensor,
    a: float,
    b: float,
    group: int,
) -> torch.Tensor:
    """With the codes fixed, the group scales minimising the output error
    tr((W - W_hat) H (W - W_hat)^T): per row a G x G least-squares solve, then E4M3 rounding.
    Keeps the old scales of a row where the rounded solution is not better."""
    n, k = w.shape
    groups = k // group
    v = _level_values(codes, a, b).view(n, groups, group)  # [N, G, g] code values
    hb = h.view(groups, group, groups, group)  # [G, g, G, g]
    lhs = torch.einsum("nai,aibj,nbj->nab", v, hb, v)  # [N, G, G]
    rhs = torch.einsum("nai,nai->na", v, (w @ h).view(n, groups, group))  # [N, G]
    ridge = 1e-6 * lhs.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)
    solved, info = torch.linalg.solve_ex(lhs + ridge[:, None, None] * torch.eye(groups), rhs)
    solved = torch.where((info == 0)[:, None] & solved.isfinite(), solved, scales).clamp_min(1e-30)
    solved = _stored_scale(solved, row_scale[:, None])

    def objective(sc: torch.Tensor) -> torch.Tensor:
        d = w - (v * sc[..., None]).view(n, k)  # [N, K]
        return ((d @ h) * d).sum(dim=1)

    return torch.where((objective(solved) < objective(scales))[:, None], solved, scales)


def w_slice(w: torch.Tensor, wb: torch.Tensor, b0: int, col: int, group: int) -> torch.Tensor:
    """The current (error-updated) weights of the group starting at `col`: [N, group]."""
    end = col + group
    block_end = b0 + wb.shape[1]
    inside = wb[:, col - b0 : min(end, block_end) - b0]
    if end <= block_end:
        return inside
    return torch.cat([inside, w[:, block_end:end]], dim=1)
