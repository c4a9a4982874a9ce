"""Conversion with low-bit experts: convert, gather calibration statistics by running the
unquantized store over calibration text, re-encode the experts, then publish the store."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from moetier.config import EngineConfig
from moetier.core.layout import blob_view
from moetier.kernels.moe_ref import expert_activation_ref, expert_matrix
from moetier.loader.load import load_model
from moetier.quant.convert import convert
from moetier.quant.dense_formats import DensePolicy
from moetier.quant.requantize import Hessians, Override, base_codecs, requantize_experts
from moetier.quant.sources import detect_quantization
from moetier.quant.store import Store

# Per-expert Hessians of every layer are held at once; past this, refuse rather than swap.
HESSIAN_MEMORY_LIMIT = 8 * 2**30


def calibration_texts(path: Path) -> list[str]:
    """A .txt file, or every .txt file of a directory (sorted)."""
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"no .txt calibration text in {path}")
    return [f.read_text(encoding="utf-8") for f in files]


def collect_hessians(
    store_dir: Path,
    texts: list[str],
    max_tokens: int = 65536,
    ctx: int = 512,
    progress: bool = True,
    routing_weighted: bool = True,
) -> Hessians:
    """For every (layer, expert): sum of x x^T over the calibration tokens routed to it, for the
    gate_up input x (hidden) and the down input (the activated intermediate); with
    `routing_weighted` each token's x is scaled by its routing weight to this expert."""
    store = Store(store_dir)
    hid, inter = store.model_config.hidden_size, store.model_config.expert_intermediate_size
    needed = len(store.blobs) * (hid * hid + inter * inter) * 4
    if needed > HESSIAN_MEMORY_LIMIT:
        raise ValueError(
            f"calibration would hold {needed / 2**30:.1f} GiB of per-expert Hessians (all "
            f"layers at once; the limit is {HESSIAN_MEMORY_LIMIT / 2**30:.0f} GiB): convert "
            "without --calibration (round to nearest) until layer-by-layer calibration lands"
        )
    loaded = load_model(store_dir, EngineConfig())
    runtime = loaded.runtime
    acc: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(
        lambda: [
            torch.zeros(hid, hid, device=loaded.device),
            torch.zeros(inter, inter, device=loaded.device),
        ]
    )

    def observe(
        layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor
    ) -> None:
        fmt = runtime.formats[layer]
        for expert in torch.unique(topk_ids).tolist():
            pairs = topk_ids == expert  # [T, k]
            rows = pairs.any(dim=-1)
            x = hidden[rows].float()  # [n, H], fp32 statistics
            # The layer output weighs each expert by its routing weight, so its error does too.
            w = (weights.float() * pairs).sum(-1)[rows, None] if routing_weighted else 1.0
            blob = store.blob(layer, expert).to(loaded.device)
            h = x @ expert_matrix(blob, fmt, "gate_up").T  # [n, 2I]
            if store.model_config.expert_has_bias:
                h = h + blob_view(blob, fmt.tensor("gate_up_bias")).float()
            gate, up = h.chunk(2, dim=-1)
            act = expert_activation_ref(gate, up, store.model_config.activation)  # [n, I]
            pair = acc[(layer, expert)]
            pair[0] += (x * w).T @ (x * w)
            pair[1] += (act * w).T @ (act * w)

    # An equal share of tokens from the start of every text, so that all of them are seen.
    share = -(-max_tokens // len(texts))
    ids: list[int] = []
    for text in texts:
        ids.extend(loaded.tokenizer.encode(text[: share * 8], add_special_tokens=False)[:share])
    n = min(len(ids), max_tokens) // ctx
    if n == 0:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    chunks = torch.tensor(ids[: n * ctx]).view(n, ctx)
    runtime.observer = observe
    with torch.inference_mode():
        for batch in tqdm(chunks.split(4), desc="calibration", disable=not progress):
            loaded.model(batch.to(loaded.device))
    runtime.observer = None
    return {key: (pair[0].cpu(), pair[1].cpu()) for key, pair in acc.items()}


def convert_quantized(
    src: str | Path,
    dst: str | Path,
    kind: str = "q2s",
    *,
    calibration: str | Path | None = None,
    calibration_tokens: int = 65536,
    group: int = 32,
    down_group: int | None = None,
    delta: str | None = None,
    overrides: Sequence[str] = (),
    force: bool = False,
    progress: bool = True,
    dense: DensePolicy | None = None,
) -> Path:
    """`moetier convert --experts KIND`: the store at `dst` holds `kind` experts (q2s, int2,
    affine2, nvfp4, mxfp4, nested), with `overrides` (`--override` strings, quant/requantize.py)
    applied per layer and matrix; calibration text (q2s only) enables GPTQ rounding.

    From an FP4 checkpoint, `kind` equal to its format or `nested` keeps the checkpoint's codes
    and block scales (bit-exact); any other kind re-encodes the dequantised weights."""
    if calibration is not None and kind != "q2s":
        raise ValueError(f"--calibration applies to --experts q2s, not {kind}")
    # Fail on bad arguments before converting (divisibility by the model's K is checked later).
    parsed = [Override.parse(text) for text in overrides]
    if kind in ("q2s", "int2", "affine2"):
        base_codecs(kind, group, down_group or group)
    quantization = detect_quantization(Path(src))
    source_fp4 = quantization.fp4 if quantization is not None else None
    keep_codes = source_fp4 is not None and kind in (source_fp4, "nested")
    if keep_codes and kind == source_fp4 and (parsed or delta):
        raise ValueError(
            f"keeping the checkpoint's {kind} codes leaves nothing to override or add a delta "
            "to: pick another --experts format to re-encode"
        )

    def finish(tmp: Path) -> None:
        if keep_codes and kind == source_fp4:
            return  # the checkpoint's own codes are already the store's experts
        hessians = None
        if calibration is not None:
            hessians = collect_hessians(
                tmp, calibration_texts(Path(calibration)), calibration_tokens, progress=progress
            )
        requantize_experts(tmp, kind, hessians, group, down_group, progress, delta, parsed)

    return convert(
        src,
        dst,
        force=force,
        progress=progress,
        finish=finish,
        keep_fp4_codes=keep_codes,
        dense=dense,
    )
