"""Re-encode the experts of an unquantized store (in place, before it is published)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from tqdm import tqdm

from moetier.core.layout import (
    TensorSpec,
    align_up,
    blob_view,
    format_kind,
    fp4_expert_format,
    has_tensor,
    nested_expert_formats,
    q2s_expert_format,
)
from moetier.kernels.moe_ref import dequant_q2s_ref
from moetier.quant.fp4 import (
    e2m1_values,
    pack_nibbles,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_nibbles,
)
from moetier.quant.q2s import pack_codes, quantize_q2s
from moetier.quant.store import BLOB_ALIGN, EXPERTS_FILE, INDEX_FILE, Store, blob_index_entry

# (layer, expert) -> (H of the gate_up input [H, H], H of the down input [I, I])
Hessians = Mapping[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


EXPERT_KINDS = ("q2s", "nvfp4", "mxfp4", "nested")


def _nested(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """NVFP4-quantise, then split the codes (_split_codes)."""
    q = quantize_nvfp4(w)
    return _split_codes(q.codes, {"scales": q.scales, "tensor_scale": q.tensor_scale})


def _split_codes(
    codes: torch.Tensor, scales: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split each E2M1 code [N, K]: base = sign and exponent MSB (code >> 2) with a 4-entry
    table of the mean value of each base code (in block-scale units, fitted on this matrix; each
    sign kept separate) and the block scales as given, delta = the two low bits."""
    high, low = codes >> 2, codes & 3
    values = e2m1_values(codes)
    fallback = torch.tensor([0.75, 3.75, -0.75, -3.75])  # mid-bin values if a code never occurs
    table = torch.stack(
        [values[high == c].mean() if bool((high == c).any()) else fallback[c] for c in range(4)]
    ).float()
    return {"codes": pack_codes(high), **scales, "table": table}, {"low": pack_codes(low)}


def _encode(
    kind: str, w: torch.Tensor, hessian: torch.Tensor | None, group: int
) -> dict[str, torch.Tensor]:
    """One matrix -> its stored parts (core/layout.py names them)."""
    if kind == "q2s":
        q = quantize_q2s(w, hessian, group=group)
        return {
            "codes": pack_codes(q.codes),
            "scales": q.scales,
            "row_scale": q.row_scale,
            "grid": q.grid.float(),
        }
    if kind == "nvfp4":
        n = quantize_nvfp4(w)
        return {"codes": pack_nibbles(n.codes), "scales": n.scales, "tensor_scale": n.tensor_scale}
    m = quantize_mxfp4(w)
    return {"codes": pack_nibbles(m.codes), "scales": m.scales}


def requantize_experts(
    store_dir: Path,
    kind: str,
    hessians: Hessians | None = None,
    group: int = 32,
    down_group: int = 16,
    progress: bool = True,
    delta: str | None = None,
) -> None:
    """Replace the store's unquantized experts by `kind` blobs (q2s, nvfp4, mxfp4, nested).
    A store of FP4 codes taken from the checkpoint (nvfp4 or mxfp4) can become `nested`: its
    codes and block scales are split as they are, so base + delta is the checkpoint bit for bit.

    delta="nvfp4" (q2s only) adds a delta plane: per expert a separate blob holding NVFP4 codes
    of W - decode(base), so that base + delta restores near-FP4 precision where it is applied.

    q2s without `hessians` rounds to nearest with an MSE scale search; with them, GPTQ rounding
    and Hessian-refitted scales (quant/q2s.py). FP4 formats round to nearest (quant/fp4.py)."""
    nested_delta = None
    if delta not in (None, "nvfp4") or (delta is not None and kind != "q2s"):
        raise ValueError(
            f"delta plane {delta!r} with {kind} experts: only q2s + nvfp4 is supported"
        )
    if kind not in EXPERT_KINDS:
        raise ValueError(f"unknown expert format {kind!r}: choose one of {', '.join(EXPERT_KINDS)}")
    store = Store(store_dir)
    cfg = store.model_config
    raw = store.blob_format(store.moe_layers[0])
    source_fp4 = format_kind(raw) if format_kind(raw) in ("nvfp4", "mxfp4") else None
    if format_kind(raw) != "raw" and not (kind == "nested" and source_fp4):
        raise ValueError(f"{store_dir}: experts are already {raw.name}, not an unquantized format")
    dims = (cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias)
    if kind == "q2s":
        fmt = q2s_expert_format(*dims, group, down_group, bias_dtype=store.source_dtype)
    elif kind == "nested":
        fmt, nested_delta = nested_expert_formats(
            *dims, bias_dtype=store.source_dtype, fp4=source_fp4 or "nvfp4"
        )
    else:
        fmt = fp4_expert_format(kind, *dims, bias_dtype=store.source_dtype)
    stride = align_up(fmt.nbytes, BLOB_ALIGN)
    keys = sorted((k[0], k[1]) for k in store.blobs)
    blobs = []
    delta_fmt = fp4_expert_format("nvfp4", *dims[:2], False) if delta else None
    if kind == "nested":
        delta_fmt = nested_delta
    delta_stride = align_up(delta_fmt.nbytes, BLOB_ALIGN) if delta_fmt else 0
    new_path = store_dir / (EXPERTS_FILE + f".{kind}")
    delta_path = store_dir / (EXPERTS_FILE + ".delta")
    # Delta blobs go to a side file, appended after all base blobs at the end, so that the base
    # plane is one contiguous region and no plane is ever held in memory whole.
    with open(new_path, "wb") as f, open(delta_path, "wb") as delta_file:
        for i, (layer, expert) in enumerate(
            tqdm(keys, desc=f"{kind} experts", disable=not progress)
        ):
            source = store.blob(layer, expert)
            fmt_in = store.blob_format(layer)
            blob = torch.zeros(stride, dtype=torch.uint8)
            delta_blob = torch.zeros(delta_stride, dtype=torch.uint8)
            h_pair = hessians.get((layer, expert)) if hessians is not None else None
            for m, name, g in ((0, "gate_up", group), (1, "down", down_group)):
                if source_fp4 is not None:  # the checkpoint's own codes and scales
                    codes = unpack_nibbles(blob_view(source, fmt_in.tensor(f"{name}.codes")))
                    scales = {
                        s.name.split(".")[1]: blob_view(source, s)
                        for s in fmt_in.tensors
                        if s.name.startswith(name + ".") and not s.name.endswith(".codes")
                    }
                    parts, low = _split_codes(codes, scales)
                    _put(delta_blob, nested_delta.tensor(f"{name}.low"), low["low"])  # type: ignore[union-attr]
                    for part, value in parts.items():
                        _put(blob, fmt.tensor(f"{name}.{part}"), value)
                    continue
                w = blob_view(source, fmt_in.tensor(name)).float()
                if kind == "nested":
                    parts, low = _nested(w)
                    assert nested_delta is not None
                    _put(delta_blob, nested_delta.tensor(f"{name}.low"), low["low"])
                else:
                    parts = _encode(kind, w, h_pair[m] if h_pair is not None else None, g)
                for part, value in parts.items():
                    _put(blob, fmt.tensor(f"{name}.{part}"), value)
                if delta is not None and delta_fmt is not None:
                    base = dequant_q2s_ref(
                        parts["codes"], parts["scales"], parts["row_scale"], parts["grid"]
                    )
                    for part, value in _encode("nvfp4", w - base, None, 0).items():
                        _put(delta_blob, delta_fmt.tensor(f"{name}.{part}"), value)
            for name in ("gate_up_bias", "down_bias"):
                if has_tensor(fmt, name):
                    _put(blob, fmt.tensor(name), blob_view(source, fmt_in.tensor(name)))
            f.write(blob.numpy().tobytes())
            blobs.append(blob_index_entry(layer, expert, i * stride, fmt, blob))
            if delta_fmt is not None:
                offset = len(keys) * stride + i * delta_stride
                delta_file.write(delta_blob.numpy().tobytes())
                blobs.append(
                    blob_index_entry(layer, expert, offset, delta_fmt, delta_blob, "delta")
                )
        delta_file.flush()
        with open(delta_path, "rb") as side:
            shutil.copyfileobj(side, f, 16 * 2**20)
    delta_path.unlink()
    index = dict(store.index)
    index["formats"] = {fmt.name: fmt.to_json()}
    if delta_fmt is not None:
        index["formats"][delta_fmt.name] = delta_fmt.to_json()
    index["blobs"] = blobs
    index["quantization"] = {"experts": kind}
    if source_fp4 is not None:
        index["quantization"]["codes"] = f"source {source_fp4}"
    if delta_fmt is not None:
        index["quantization"]["delta"] = delta or "nested"
    if kind == "q2s":
        index["quantization"].update(
            group=group,
            down_group=down_group,
            rounding="gptq" if hessians is not None else "nearest",
        )
    store.close()
    os.replace(new_path, store_dir / EXPERTS_FILE)
    (store_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))


def _put(blob: torch.Tensor, spec: TensorSpec, value: torch.Tensor) -> None:
    blob[spec.offset : spec.offset + spec.nbytes] = value.contiguous().view(-1).view(torch.uint8)
