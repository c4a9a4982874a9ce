"""Re-encode the experts of an unquantized store (in place, before it is published)."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moetier.core.layout import (
    MATRICES,
    BlobFormat,
    MatrixCodec,
    TensorSpec,
    align_up,
    blob_view,
    coded_expert_format,
    format_kind,
    has_tensor,
    nested_expert_formats,
)
from moetier.kernels.moe_ref import expert_matrix
from moetier.quant.baselines import quantize_affine2, quantize_int2
from moetier.quant.fp4 import (
    e2m1_values,
    pack_nibbles,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_nibbles,
)
from moetier.quant.q2s import pack_codes, quantize_q2s
from moetier.quant.store import (
    BLOB_ALIGN,
    EXPERTS_FILE,
    INDEX_FILE,
    Store,
    blob_index_entry,
    crc32,
)
from moetier.quant.work_folder import Journal, fault, say

REQUANTIZE_JOURNAL = "experts.requantize.jsonl"  # resume=True: the experts re-encoded so far
# (layer, expert) -> (H of the gate_up input [H, H], H of the down input [I, I])
Hessians = Mapping[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


EXPERT_KINDS = ("q2s", "int2", "affine2", "nvfp4", "mxfp4", "nested")
DELTA_KINDS = ("nvfp4", "q2")
# The 2-bit delta plane: q2s at group 16 on both matrices (the residual is narrower-tailed than
# W, and the finer scales are what a second 2-bit plane buys).
Q2_DELTA = MatrixCodec("q2s", 16)
OVERRIDE_HELP = (
    "[layers=L:][gate_up=|down=]FORMAT, e.g. down=q2s-g16, layers=0-1:nvfp4, "
    "layers=0,3-4:down=int2-g16 (L: layer numbers of the checkpoint, a-b ranges, comma-separated)"
)


@dataclass(frozen=True)
class Override:
    """One `--override`: `FORMAT` for `matrices` of `layers` (None: every MoE layer)."""

    codec: MatrixCodec
    matrices: tuple[str, ...] = MATRICES
    layers: frozenset[int] | None = None

    @classmethod
    def parse(cls, text: str) -> Override:
        rest, layers = text.strip(), None
        try:
            if rest.startswith("layers="):
                spec, sep, rest = rest.removeprefix("layers=").partition(":")
                if not sep:
                    raise ValueError("no ':' after the layers")
                layers = frozenset(_layer_numbers(spec))
            matrices: tuple[str, ...] = MATRICES
            head, sep, tail = rest.partition("=")
            if sep:
                if head not in MATRICES:
                    raise ValueError(f"{head!r} is not a matrix (gate_up or down)")
                matrices, rest = (head,), tail
            return cls(MatrixCodec.parse(rest), matrices, layers)
        except ValueError as err:
            raise ValueError(f"--override {text!r}: {err}; the form is {OVERRIDE_HELP}") from None


def _layer_numbers(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad layer list {spec!r}")
        if sep and int(hi) < int(lo):  # range() of it is empty: the override would do nothing
            raise ValueError(f"the layer range {part!r} runs backwards (write {hi}-{lo})")
        out += range(int(lo), int(hi if sep else lo) + 1)
    return out


def check_planes(kind: str, delta: str | None, overrides: Sequence[Override] = ()) -> None:
    """Refuse an expert format, delta plane or overrides that do not go together (before any
    work: convert_quantized checks them first)."""
    if kind not in EXPERT_KINDS:
        raise ValueError(f"unknown expert format {kind!r}: choose one of {', '.join(EXPERT_KINDS)}")
    if delta not in (None, *DELTA_KINDS):
        raise ValueError(f"delta plane {delta!r}: choose {' or '.join(DELTA_KINDS)}")
    if kind == "nested" and delta is not None:
        raise ValueError(
            f"--delta {delta} does not apply to --experts nested: nested experts already have "
            "their delta plane (the FP4 codes' low bits). Drop --delta, or choose a base format "
            "that takes one (q2s, int2, affine2, nvfp4, mxfp4)"
        )
    if kind == "nested" and overrides:
        raise ValueError("--override does not apply to nested experts (one FP4 bit-plane split)")


def base_codecs(kind: str, group: int, down_group: int) -> dict[str, MatrixCodec]:
    """The per-matrix codecs of `--experts kind` before overrides."""
    if kind in ("nvfp4", "mxfp4"):
        codec = MatrixCodec.parse(kind)
        return {"gate_up": codec, "down": codec}
    return {"gate_up": MatrixCodec(kind, group), "down": MatrixCodec(kind, down_group)}


def layer_codecs(
    kind: str, group: int, down_group: int, overrides: Sequence[Override], layers: Sequence[int]
) -> dict[int, dict[str, MatrixCodec]]:
    """layer -> matrix -> codec: `kind` everywhere, then each override in order (the last wins)."""
    plan = {layer: base_codecs(kind, group, down_group) for layer in layers}
    for override in overrides:
        unknown = sorted((override.layers or frozenset()) - set(layers))
        if unknown:
            raise ValueError(
                f"--override names layer(s) {unknown} that have no routed experts; "
                f"the MoE layers are {list(layers)}"
            )
        for layer in layers:
            if override.layers is None or layer in override.layers:
                for matrix in override.matrices:
                    plan[layer][matrix] = override.codec
    return plan


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
    codec: MatrixCodec, w: torch.Tensor, hessian: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """One matrix -> its stored parts (core/layout.MatrixCodec names them). The Hessian is used
    by q2s only (GPTQ rounding); the other codecs round to nearest."""
    if codec.kind == "q2s":
        q = quantize_q2s(w, hessian, group=codec.group)
        return {
            "codes": pack_codes(q.codes),
            "scales": q.scales,
            "row_scale": q.row_scale,
            "grid": q.grid.float(),
        }
    if codec.kind == "int2":
        i = quantize_int2(w, codec.group)
        return {"codes": pack_codes(i.codes), "scales": i.scales}
    if codec.kind == "affine2":
        a = quantize_affine2(w, codec.group)
        return {"codes": pack_codes(a.codes), "scales": a.scales, "zeros": a.zeros}
    if codec.kind == "nvfp4":
        n = quantize_nvfp4(w)
        return {"codes": pack_nibbles(n.codes), "scales": n.scales, "tensor_scale": n.tensor_scale}
    m = quantize_mxfp4(w)
    return {"codes": pack_nibbles(m.codes), "scales": m.scales}


def requantize_experts(
    store_dir: Path,
    kind: str,
    hessians: Hessians | None = None,
    group: int = 32,
    down_group: int | None = None,
    progress: bool = True,
    delta: str | None = None,
    overrides: Sequence[Override] = (),
    resume: bool = False,
) -> None:
    """Replace the store's unquantized experts by `kind` blobs (q2s, int2, affine2, nvfp4, mxfp4,
    nested); `down_group` defaults to 16 for q2s and to `group` otherwise. `overrides` change the
    format of chosen matrices and layers, so layers may differ in format (each layer's blobs
    name theirs). A store of FP4 codes taken from the checkpoint (nvfp4 or mxfp4) can become
    `nested`: its codes and block scales are split as they are, so base + delta is the
    checkpoint bit for bit.

    delta="nvfp4" or "q2" adds a delta plane: per expert a separate blob holding W - decode(base)
    coded as NVFP4 or as 2-bit q2s (g16; GPTQ-rounded when there are Hessians), added to the base
    where the engine applies it.

    q2s without `hessians` rounds to nearest with an MSE scale search; with them, GPTQ rounding
    and Hessian-refitted scales (quant/q2s.py). The other formats round to nearest.

    `resume`: each re-encoded expert is committed to a journal beside (REQUANTIZE_JOURNAL), and
    a call stopped midway is continued by the next one with the same arguments: the experts
    whose bytes still match their journal crc32 are kept, the others re-encoded."""
    check_planes(kind, delta, overrides)
    if down_group is None:
        down_group = 16 if kind == "q2s" else group
    store = Store(store_dir)
    cfg = store.model_config
    raw = store.blob_format(store.moe_layers[0])
    source_fp4 = format_kind(raw) if format_kind(raw) in ("nvfp4", "mxfp4") else None
    if format_kind(raw) != "raw" and not (kind == "nested" and source_fp4):
        raise ValueError(f"{store_dir}: experts are already {raw.name}, not an unquantized format")
    dims = (cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias)
    codecs = {}
    nested_delta = None
    if kind == "nested":
        nested_base, nested_delta = nested_expert_formats(
            *dims, bias_dtype=store.source_dtype, fp4=source_fp4 or "nvfp4"
        )
        formats = dict.fromkeys(store.expert_layers, nested_base)
    else:
        # MTP layers' experts (store.expert_layers) are re-encoded like the main model's
        codecs = layer_codecs(kind, group, down_group, overrides, store.expert_layers)
        formats = {
            layer: coded_expert_format(
                c["gate_up"], c["down"], *dims, bias_dtype=store.source_dtype
            )
            for layer, c in codecs.items()
        }
    delta_codec = {"nvfp4": MatrixCodec.parse("nvfp4"), "q2": Q2_DELTA}.get(delta or "")
    delta_fmt: BlobFormat | None = nested_delta
    if delta_codec is not None:
        delta_fmt = coded_expert_format(delta_codec, delta_codec, *dims[:2], False)
    keys = sorted((k[0], k[1]) for k in store.all_blobs)
    strides = {layer: align_up(fmt.nbytes, BLOB_ALIGN) for layer, fmt in formats.items()}
    base_bytes = sum(strides[layer] for layer, _ in keys)
    delta_stride = align_up(delta_fmt.nbytes, BLOB_ALIGN) if delta_fmt else 0
    blobs = []
    new_path = store_dir / (EXPERTS_FILE + f".{kind}")
    delta_path = store_dir / (EXPERTS_FILE + ".delta")
    journal = Journal(store_dir / REQUANTIZE_JOURNAL) if resume else None
    kept = _kept(journal, new_path, delta_path, delta_stride) if journal is not None else []
    for record in kept:
        blobs += [record["base"], *([record["delta"]] if record["delta"] else [])]
    offset = kept[-1]["end"] if kept else 0
    if kept:
        say(f"{len(kept)} of {len(keys)} experts were re-encoded by an earlier run and are kept")
    mode = "r+b" if kept else "wb"
    # Delta blobs go to a side file, appended after all base blobs at the end, so that the base
    # plane is one contiguous region and no plane is ever held in memory whole.
    with open(new_path, mode) as f, open(delta_path, mode) as delta_file:
        f.truncate(offset)
        f.seek(offset)
        delta_file.truncate(len(kept) * delta_stride)
        delta_file.seek(len(kept) * delta_stride)
        for i in tqdm(range(len(kept), len(keys)), desc=f"{kind} experts", disable=not progress,
                      initial=len(kept), total=len(keys)):  # fmt: skip
            layer, expert = keys[i]
            source = store.read_blob(layer, expert)
            fmt_in, fmt = store.blob_format(layer), formats[layer]
            blob = torch.zeros(strides[layer], dtype=torch.uint8)
            delta_blob = torch.zeros(delta_stride, dtype=torch.uint8)
            h_pair = hessians.get((layer, expert)) if hessians is not None else None
            for m, name in enumerate(MATRICES):
                if source_fp4 is not None:  # the checkpoint's own codes and scales
                    assert nested_delta is not None
                    codes = unpack_nibbles(blob_view(source, fmt_in.tensor(f"{name}.codes")))
                    scales = {
                        s.name.split(".")[1]: blob_view(source, s)
                        for s in fmt_in.tensors
                        if s.name.startswith(name + ".") and not s.name.endswith(".codes")
                    }
                    parts, low = _split_codes(codes, scales)
                    _put(delta_blob, nested_delta.tensor(f"{name}.low"), low["low"])
                    for part, value in parts.items():
                        _put(blob, fmt.tensor(f"{name}.{part}"), value)
                    continue
                w = blob_view(source, fmt_in.tensor(name)).float()
                hessian = h_pair[m] if h_pair is not None else None
                if nested_delta is not None:
                    parts, low = _nested(w)
                    _put(delta_blob, nested_delta.tensor(f"{name}.low"), low["low"])
                else:
                    parts = _encode(codecs[layer][name], w, hessian)
                for part, value in parts.items():
                    _put(blob, fmt.tensor(f"{name}.{part}"), value)
                if delta_codec is not None and delta_fmt is not None:
                    residual = w - expert_matrix(blob, fmt, name)  # what the base leaves out
                    h_delta = hessian if delta_codec.kind == "q2s" else None
                    for part, value in _encode(delta_codec, residual, h_delta).items():
                        _put(delta_blob, delta_fmt.tensor(f"{name}.{part}"), value)
            for name in ("gate_up_bias", "down_bias"):
                if has_tensor(fmt, name):
                    _put(blob, fmt.tensor(name), blob_view(source, fmt_in.tensor(name)))
            f.write(blob.numpy().tobytes())
            blobs.append(blob_index_entry(layer, expert, offset, fmt, blob))
            offset += strides[layer]
            if delta_fmt is not None:
                delta_file.write(delta_blob.numpy().tobytes())
                blobs.append(
                    blob_index_entry(
                        layer, expert, base_bytes + i * delta_stride, delta_fmt, delta_blob, "delta"
                    )
                )
            if journal is not None:
                f.flush()
                delta_file.flush()
                journal.commit(
                    {
                        "requantized": i,
                        "end": offset,
                        "crc32": crc32(blob),
                        "delta_crc32": crc32(delta_blob) if delta_fmt is not None else None,
                        "base": blobs[-2] if delta_fmt is not None else blobs[-1],
                        "delta": blobs[-1] if delta_fmt is not None else None,
                    }
                )
                fault("requantize", i + 1)
        delta_file.flush()
        with open(delta_path, "rb") as side:
            shutil.copyfileobj(side, f, 16 * 2**20)
    delta_path.unlink()
    index = dict(store.index)
    index["formats"] = {}
    for fmt in [*formats.values(), *([delta_fmt] if delta_fmt else [])]:
        if index["formats"].setdefault(fmt.name, fmt.to_json()) != fmt.to_json():
            raise RuntimeError(f"two layouts named {fmt.name}")  # a naming bug, not user input
    index["blobs"] = blobs
    index["quantization"] = {"experts": kind}
    if source_fp4 is not None:
        index["quantization"]["codes"] = f"source {source_fp4}"
    if delta_fmt is not None:
        index["quantization"]["delta"] = delta or "nested"
    if kind in ("q2s", "int2", "affine2"):
        index["quantization"].update(group=group, down_group=down_group)
    if kind == "q2s":
        index["quantization"]["rounding"] = "gptq" if hessians is not None else "nearest"
    if overrides:
        index["quantization"]["overrides"] = {
            str(layer): {m: c.name for m, c in layer_plan.items()}
            for layer, layer_plan in codecs.items()
        }
    store.close()
    os.replace(new_path, store_dir / EXPERTS_FILE)
    (store_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
    if journal is not None:
        journal.close()
        journal.path.unlink()


def _kept(
    journal: Journal, new_path: Path, delta_path: Path, delta_stride: int
) -> list[dict[str, Any]]:
    """The journal's re-encoded experts, in order, whose base and delta bytes still have their
    crc32; the journal keeps only those."""
    kept: list[dict[str, Any]] = []
    records = journal.of("requantized")
    if records and new_path.exists() and delta_path.exists():
        with open(new_path, "rb") as f, open(delta_path, "rb") as side:
            for i, record in enumerate(records):
                begin = kept[-1]["end"] if kept else 0
                f.seek(begin)
                side.seek(i * delta_stride)
                base = f.read(record["end"] - begin)
                delta = side.read(delta_stride)
                if (
                    record["requantized"] != i
                    or zlib.crc32(base) != record["crc32"]
                    or (record["delta"] and zlib.crc32(delta) != record["delta_crc32"])
                ):
                    break
                kept.append(record)
    if len(kept) != len(records):
        journal.rewrite([r for r in journal.records if "requantized" not in r] + kept)
    return kept


def _put(blob: torch.Tensor, spec: TensorSpec, value: torch.Tensor) -> None:
    blob[spec.offset : spec.offset + spec.nbytes] = value.contiguous().view(-1).view(torch.uint8)
