"""Re-encode the experts of an unquantized store in q2s (in place, before it is published)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from tqdm import tqdm

from moetier.core.layout import align_up, blob_view, has_tensor, q2s_expert_format
from moetier.quant.q2s import pack_codes, quantize_q2s
from moetier.quant.store import BLOB_ALIGN, EXPERTS_FILE, INDEX_FILE, Store, blob_index_entry

# (layer, expert) -> (H of the gate_up input [H, H], H of the down input [I, I])
Hessians = Mapping[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


def requantize_q2s(
    store_dir: Path,
    hessians: Hessians | None,
    group: int = 32,
    down_group: int = 16,
    progress: bool = True,
) -> None:
    """Replace the store's raw experts by q2s blobs. Without `hessians`: round to nearest with an
    MSE scale search; with them: GPTQ rounding and Hessian-refitted scales (quant/q2s.py)."""
    store = Store(store_dir)
    cfg = store.model_config
    raw = store.blob_format(store.moe_layers[0])
    if not has_tensor(raw, "gate_up"):
        raise ValueError(f"{store_dir}: experts are already {raw.name}, not an unquantized format")
    fmt = q2s_expert_format(
        cfg.hidden_size,
        cfg.expert_intermediate_size,
        cfg.expert_has_bias,
        group,
        down_group,
        bias_dtype=store.source_dtype,
    )
    stride = align_up(fmt.nbytes, BLOB_ALIGN)
    keys = sorted((k[0], k[1]) for k in store.blobs)
    blobs = []
    new_path = store_dir / (EXPERTS_FILE + ".q2s")
    with open(new_path, "wb") as f:
        for i, (layer, expert) in enumerate(tqdm(keys, desc="q2s experts", disable=not progress)):
            source = store.blob(layer, expert)
            fmt_in = store.blob_format(layer)
            blob = torch.zeros(stride, dtype=torch.uint8)
            h_pair = hessians.get((layer, expert)) if hessians is not None else None
            for m, name, g in ((0, "gate_up", group), (1, "down", down_group)):
                w = blob_view(source, fmt_in.tensor(name)).float()
                q = quantize_q2s(w, h_pair[m] if h_pair is not None else None, group=g)
                for part, value in (
                    ("codes", pack_codes(q.codes)),
                    ("scales", q.scales),
                    ("row_scale", q.row_scale),
                    ("grid", q.grid.float()),
                ):
                    spec = fmt.tensor(f"{name}.{part}")
                    blob[spec.offset : spec.offset + spec.nbytes] = (
                        value.contiguous().view(-1).view(torch.uint8)
                    )
            for name in ("gate_up_bias", "down_bias"):
                if has_tensor(fmt, name):
                    spec = fmt.tensor(name)
                    blob[spec.offset : spec.offset + spec.nbytes] = (
                        blob_view(source, fmt_in.tensor(name)).view(-1).view(torch.uint8)
                    )
            f.write(blob.numpy().tobytes())
            blobs.append(blob_index_entry(layer, expert, i * stride, fmt, blob))
    index = dict(store.index)
    index["formats"] = {fmt.name: fmt.to_json()}
    index["blobs"] = blobs
    index["quantization"] = {
        "experts": "q2s",
        "group": group,
        "down_group": down_group,
        "rounding": "gptq" if hessians is not None else "nearest",
    }
    store.close()
    os.replace(new_path, store_dir / EXPERTS_FILE)
    (store_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
