"""Plain-torch reference MoE kernel: experts read through an expert->slot table.

This is the CPU path and the twin every Triton kernel is tested against. Written for clarity,
not speed: a Python loop over the experts that have a slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat, blob_view, format_kind, has_tensor, matrix_codecs

Q2S_SHIFTS = (0, 2, 4, 6)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequant_q2s_ref(
    codes: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """q2s decode (core/layout.q2s_expert_format) -> [N, K] float32.

    codes:     [N, K // 4] uint8, code j of a byte at bits 2j..2j+1 (little-endian along K)
    scales:    [N, K // g] float8_e4m3fn group scales
    row_scale: [N] float32
    grid:      [2] float32 (a, b); codes 0..3 decode to (-b, -a, +a, +b)
    """
    unpacked = _unpack2(codes).long()  # [N, K]
    a, b = grid[0], grid[1]
    levels = torch.stack([-b, -a, a, b]).float()
    group = unpacked.shape[1] // scales.shape[1]
    group_scale = scales.float().repeat_interleave(group, dim=1)  # [N, K]
    return row_scale.float()[:, None] * group_scale * levels[unpacked]


def dequant_int2_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Naive int2 decode (core/layout.MatrixCodec int2-gG) -> [N, K] float32.

    codes:  [N, K // 4] uint8, packed as q2s; code c decodes to c - 2 (so -2, -1, 0, 1)
    scales: [N, K // G] float16, absmax / 2 of each group
    """
    unpacked = _unpack2(codes).float() - 2  # [N, K]
    group = unpacked.shape[1] // scales.shape[1]
    return unpacked * scales.float().repeat_interleave(group, dim=1)


def dequant_affine2_ref(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """Asymmetric affine 2-bit decode (core/layout.MatrixCodec affine2-gG) -> [N, K] float32.

    codes:  [N, K // 4] uint8, packed as q2s, values 0..3
    scales: [N, K // G] float16;  zeros: [N, K // G] float16 (in code units)
    W = (code - zero) * scale
    """
    unpacked = _unpack2(codes).float()  # [N, K]
    group = unpacked.shape[1] // scales.shape[1]
    zero = zeros.float().repeat_interleave(group, dim=1)
    return (unpacked - zero) * scales.float().repeat_interleave(group, dim=1)


def dequant_fp4_ref(
    codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None
) -> torch.Tensor:
    """NVFP4 / MXFP4 decode (core/layout.fp4_expert_format) -> [N, K] float32.

    codes:        [N, K // 2] uint8, two E2M1 codes per byte, element 2j in the low nibble;
                  code bit 3 is the sign, bits 0..2 index E2M1_MAGNITUDES
    scales:       [N, K // 16] float8_e4m3fn with tensor_scale [1] float32 (NVFP4), or
                  [N, K // 32] uint8 E8M0, scale 2^(s - 127) (MXFP4, tensor_scale None)
    """
    return _fp4_decode(unpack_fp4(codes), scales, tensor_scale)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any shape, 0..15: bit 3 the sign, bits 0..2 index E2M1_MAGNITUDES) ->
    float32 values; the one E2M1 decode every other module uses."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitudes, magnitudes)


def unpack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K // 2] uint8, element 2j in the low nibble -> [..., K] codes 0..15."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)


def _fp4_decode(
    nibbles: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None
) -> torch.Tensor:
    """Unpacked E2M1 codes [N, K] (uint8 0..15) and their block scales -> [N, K] float32."""
    values = e2m1_values(nibbles)
    block = values.shape[1] // scales.shape[1]
    if tensor_scale is None:
        return values * torch.exp2(scales.float() - 127).repeat_interleave(block, dim=1)
    return values * scales.float().repeat_interleave(block, dim=1) * tensor_scale.float()


def expert_matrix(blob: torch.Tensor, fmt: BlobFormat, name: str) -> torch.Tensor:
    """Matrix `name` ("gate_up" or "down") of one expert blob, decoded to float32 [N, K].
    Each matrix is decoded by its own codec (core/layout.matrix_codecs), so a blob may mix them."""
    kind = format_kind(fmt)
    if kind == "raw":
        return blob_view(blob, fmt.tensor(name)).float()

    def part(p: str) -> torch.Tensor:
        return blob_view(blob, fmt.tensor(f"{name}.{p}"))

    if kind == "nested-base":
        codes = _unpack2(part("codes"))  # [N, K] 0..3
        block = codes.shape[1] // part("scales").shape[1]
        if has_tensor(fmt, f"{name}.tensor_scale"):  # NVFP4 scales
            scale = part("scales").float() * part("tensor_scale").float()
        else:  # MXFP4 (E8M0) scales
            scale = torch.exp2(part("scales").float() - 127)
        return part("table").float()[codes.long()] * scale.repeat_interleave(block, dim=1)
    if kind == "nested-delta":
        raise ValueError("a nested delta blob decodes only together with its base blob")
    codecs = matrix_codecs(fmt)
    assert codecs is not None  # format_kind said it is coded
    codec = codecs[name].kind
    if codec == "q2s":
        return dequant_q2s_ref(part("codes"), part("scales"), part("row_scale"), part("grid"))
    if codec == "int2":
        return dequant_int2_ref(part("codes"), part("scales"))
    if codec == "affine2":
        return dequant_affine2_ref(part("codes"), part("scales"), part("zeros"))
    return dequant_fp4_ref(
        part("codes"), part("scales"), part("tensor_scale") if codec == "nvfp4" else None
    )


def _unpack2(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 4] uint8 -> [N, K] 2-bit values, value j of a byte at bits 2j..2j+1."""
    shifts = torch.tensor(Q2S_SHIFTS, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 3).reshape(packed.shape[0], -1)


def expert_matrix_with_delta(
    blob: torch.Tensor, fmt: BlobFormat, delta: torch.Tensor, delta_fmt: BlobFormat, name: str
) -> torch.Tensor:
    """Matrix `name` with the delta plane applied: base + delta for an additive delta; for a
    nested delta the FP4 code rebuilt from both planes, (base << 2) | low (bit-exact FP4)."""
    if format_kind(delta_fmt) != "nested-delta":
        return expert_matrix(blob, fmt, name) + expert_matrix(delta, delta_fmt, name)
    high = _unpack2(blob_view(blob, fmt.tensor(f"{name}.codes")))
    low = _unpack2(blob_view(delta, delta_fmt.tensor(f"{name}.low")))
    tensor_scale = (
        blob_view(blob, fmt.tensor(f"{name}.tensor_scale"))
        if has_tensor(fmt, f"{name}.tensor_scale")
        else None  # MXFP4 scales
    )
    return _fp4_decode(
        (high << 2) | low,  # [N, K] E2M1 codes
        blob_view(blob, fmt.tensor(f"{name}.scales")),
        tensor_scale,
    )


def quant_words_ref(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] -> x rounded to int8 per 16-column word (scale absmax / 127, round half up),
    returned dequantized in float32: the activations the int8 q2s GEMV kernel multiplies
    (int8_words.quant_words / `_quant_words_kernel`)."""
    rows, k = x.shape
    v = x.float().reshape(rows, k // 16, 16)
    amax = v.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.floor(v * inv + 0.5)
    return (q * (amax / 127.0)).reshape(rows, k)


def expert_activation_ref(
    gate: torch.Tensor, up: torch.Tensor, act: ExpertActivation
) -> torch.Tensor:
    """gate, up: [n, I] -> [n, I], the family's gated activation (config.ACTIVATIONS)."""
    if act.kind == "silu":
        return F.silu(gate) * up
    if act.kind == "silu_clamped":
        return F.silu(gate.clamp(max=act.limit)) * up.clamp(min=-act.limit, max=act.limit)
    if act.kind == "gpt_oss":
        gate = gate.clamp(max=act.limit)
        up = up.clamp(min=-act.limit, max=act.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))
    raise ValueError(f"unknown expert activation {act.kind!r}")


def moe_slots_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_table: torch.Tensor,
    pool: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    out: torch.Tensor,
    delta_mask: torch.Tensor | None = None,
    delta_table: torch.Tensor | None = None,
    delta_fmt: BlobFormat | None = None,
    act_int8: bool = False,
    act_sketch: torch.Tensor | None = None,
    act_coef: torch.Tensor | None = None,
    act_threshold: torch.Tensor | None = None,
) -> None:
    """Compute the routed pairs whose expert has a slot, writing each into `out`.

    hidden:       [T, H] float (compute dtype)
    topk_ids:     [T, k] int64, expert of each (token, k) pair
    topk_weights: [T, k] float, routing weight of each pair
    slot_table:   [E] int32, slot of each expert's base blob in `pool`, -1 = not in this call
    pool:         [S, slot_bytes] uint8, each slot one blob (base: `fmt`, delta: `delta_fmt`)
    out:          [T, k, H] float32; out[t, j] = w[t, j] * expert(hidden[t]) for every pair
                  whose expert has a slot; other rows are left untouched
    delta_mask:   [T, k] bool, pairs that use base + delta weights (additive delta plane)
    delta_table:  [E] int32, slot of each expert's delta blob, -1 = none; an expert's delta is
                  read only when one of its pairs has the mask on
    act_int8:     both matrices' inputs rounded as `quant_words_ref` and the MLP run in float32
                  (the twin of the q2s GEMV kernel with int8 activations)
    act_sketch:   [E, R, I] float, the gate's act term (gate/policies.ActGate): before the
                  delta is applied, each slotted pair's mask becomes
                  delta_mask & (act_coef · ‖act_sketch[e] h‖² >= act_threshold), h the pair's
                  base hidden activation in float32 (`act_energy_ref`), written into
                  `delta_mask` in place; act_coef, act_threshold [T, k] float32
    """
    if (
        hidden.dim() != 2
        or topk_ids.shape != topk_weights.shape
        or topk_ids.shape[0] != hidden.shape[0]
    ):
        raise ValueError(
            f"bad shapes: hidden {tuple(hidden.shape)}, ids {tuple(topk_ids.shape)}, "
            f"weights {tuple(topk_weights.shape)}"
        )
    if out.shape != (*topk_ids.shape, hidden.shape[1]):
        raise ValueError(f"out must be [T, k, H], got {tuple(out.shape)}")
    if act_sketch is not None and (delta_mask is None or act_coef is None or act_threshold is None):
        raise ValueError("the act term needs delta_mask, act_coef and act_threshold")
    pair_slots = slot_table.long()[topk_ids]  # [T, k]
    for expert in torch.unique(topk_ids[pair_slots >= 0]).tolist():
        token_idx, k_idx = torch.where(topk_ids == expert)
        blob = pool[int(slot_table[expert])]
        gate_up = expert_matrix(blob, fmt, "gate_up")  # [2I, H] float32
        down = expert_matrix(blob, fmt, "down")  # [H, I]
        if act_sketch is not None:
            assert delta_mask is not None and act_coef is not None and act_threshold is not None
            h = _expert_hidden(hidden[token_idx].float(), gate_up, blob, fmt, act)
            energy = act_energy_ref(h, act_sketch[expert])
            keep = act_coef[token_idx, k_idx].float() * energy >= act_threshold[
                token_idx, k_idx
            ].float()  # fmt: skip
            delta_mask[token_idx, k_idx] = delta_mask[token_idx, k_idx] & keep
        use_delta = torch.zeros_like(token_idx, dtype=torch.bool)
        if delta_mask is not None and delta_table is not None and int(delta_table[expert]) >= 0:
            use_delta = delta_mask[token_idx, k_idx]
        for with_delta in (False, True):
            rows = use_delta if with_delta else ~use_delta
            if not bool(rows.any()):
                continue
            w_gu, w_down = gate_up, down
            if with_delta:
                assert delta_fmt is not None and delta_table is not None
                delta = pool[int(delta_table[expert])]
                w_gu = expert_matrix_with_delta(blob, fmt, delta, delta_fmt, "gate_up")
                w_down = expert_matrix_with_delta(blob, fmt, delta, delta_fmt, "down")
            t, j = token_idx[rows], k_idx[rows]
            y = _expert_mlp(hidden[t], w_gu, w_down, blob, fmt, act, act_int8)  # [n, H]
            out[t, j] = y.to(out.dtype) * topk_weights[t, j, None].to(out.dtype)


def act_energy_ref(h: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """The act term of pairs of one expert: h [n, I] base hidden activations, sketch [R, I] ->
    ‖sketch h‖² [n] float32."""
    return (h.float() @ sketch.float().t()).pow(2).sum(-1)


def _expert_hidden(
    x: torch.Tensor, gate_up: torch.Tensor, blob: torch.Tensor, fmt: BlobFormat,
    act: ExpertActivation,
) -> torch.Tensor:  # fmt: skip
    """x [n, H] -> the hidden activation act(W_gate x + b, W_up x + b) [n, I] in x's dtype."""
    h = F.linear(x, gate_up.to(x.dtype))  # [n, 2I]
    if has_tensor(fmt, "gate_up_bias"):
        h = h + blob_view(blob, fmt.tensor("gate_up_bias")).to(x.dtype)
    gate, up = h.chunk(2, dim=-1)
    return expert_activation_ref(gate, up, act)


def _expert_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    blob: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    act_int8: bool = False,
) -> torch.Tensor:
    """x [n, H] -> [n, H] in x's dtype; biases (gpt-oss) come from the base blob. act_int8:
    inputs of both matrices rounded to int8 words (`quant_words_ref`), float32 throughout."""
    if act_int8:
        x = quant_words_ref(x)
    h = _expert_hidden(x, gate_up, blob, fmt, act)
    if act_int8:
        h = quant_words_ref(h)
    y = F.linear(h, down.to(x.dtype))
    if has_tensor(fmt, "down_bias"):
        y = y + blob_view(blob, fmt.tensor("down_bias")).to(x.dtype)
    return y
