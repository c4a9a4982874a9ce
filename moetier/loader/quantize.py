"""Conversion with low-bit experts: round to nearest (convert, then re-encode the experts of the
unquantized store), or calibrated layer by layer from the source shards
(quant/calibration/sequential.py), then publish the store."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from moetier.core.layout import MatrixCodec, align_up, coded_expert_format, nested_expert_formats
from moetier.quant.calibration.sequential import convert_calibrated
from moetier.quant.convert import ConversionPlan, convert
from moetier.quant.dense_formats import DensePolicy
from moetier.quant.requantize import (
    Q2_DELTA,
    Override,
    base_codecs,
    check_planes,
    layer_codecs,
    requantize_experts,
)
from moetier.quant.sources import detect_quantization
from moetier.quant.store import BLOB_ALIGN
from moetier.quant.work_folder import DestinationLock


def convert_quantized(
    src: str | Path,
    dst: str | Path,
    kind: str = "q2s",
    *,
    calibration: str | Path | None = None,
    calibration_tokens: int = 65536,
    calibration_mode: str = "gptq",
    calibration_target: str = "quantized",
    calibration_refine: int = 0,
    group: int = 32,
    down_group: int | None = None,
    delta: str | None = None,
    overrides: Sequence[str] = (),
    force: bool = False,
    progress: bool = True,
    dense: DensePolicy | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """`moetier convert --experts KIND`: the store at `dst` holds `kind` experts (q2s, int2,
    affine2, nvfp4, mxfp4, nested), with `overrides` (`--override` strings, quant/requantize.py)
    applied per layer and matrix; calibration text (q2s only) enables GPTQ rounding
    (`calibration_mode` "gptq") or importance-weighted rounding ("diag"), layer by layer.

    From an FP4 checkpoint, `kind` equal to its format or `nested` keeps the checkpoint's codes
    and block scales (bit-exact); any other kind re-encodes the dequantised weights.
    `tokenizer`: a folder whose tokenizer files replace the checkpoint's (not with
    calibration, which reads the checkpoint's own tokenizer)."""
    if calibration is not None and kind != "q2s":
        raise ValueError(f"--calibration applies to --experts q2s, not {kind}")
    # Fail on bad arguments before converting (divisibility by the model's K is checked later).
    parsed = [Override.parse(text) for text in overrides]
    check_planes(kind, delta, parsed)
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

    if calibration is not None:
        if tokenizer is not None:
            raise ValueError(
                "--calibration reads the checkpoint's own tokenizer: copy the tokenizer files "
                "into the checkpoint folder instead of passing --tokenizer"
            )
        with DestinationLock(Path(dst)):  # one conversion into dst at a time
            return convert_calibrated(
                src,
                dst,
                calibration,
                tokens=calibration_tokens,
                mode=calibration_mode,
                target=calibration_target,
                refine=calibration_refine,
                group=group,
                down_group=16 if down_group is None else down_group,
                delta=delta,
                overrides=parsed,
                force=force,
                progress=progress,
                dense=dense,
            )

    def finish(tmp: Path) -> None:
        if keep_codes and kind == source_fp4:
            return  # the checkpoint's own codes are already the store's experts
        requantize_experts(tmp, kind, None, group, down_group, progress, delta, parsed, resume=True)

    def finish_bytes(plan: ConversionPlan) -> int:
        """The re-encoded experts file, written while the unquantized one is still there."""
        cfg = plan.model_config
        dims = (cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias)
        layers = sorted({**plan.experts, **plan.mtp_experts})
        if kind == "nested":
            fmts = nested_expert_formats(
                *dims, bias_dtype=plan.expert_dtype, fp4=source_fp4 or "nvfp4"
            )
            per_layer = sum(align_up(f.nbytes, BLOB_ALIGN) for f in fmts)
            return per_layer * cfg.num_experts * len(layers)
        codecs = layer_codecs(
            kind, group, down_group or (16 if kind == "q2s" else group), parsed, layers
        )
        total = 0
        for c in codecs.values():
            fmt = coded_expert_format(c["gate_up"], c["down"], *dims, bias_dtype=plan.expert_dtype)
            total += align_up(fmt.nbytes, BLOB_ALIGN)
        if delta is not None:
            codec = MatrixCodec.parse("nvfp4") if delta == "nvfp4" else Q2_DELTA
            fmt = coded_expert_format(codec, codec, *dims[:2], False)
            total += align_up(fmt.nbytes, BLOB_ALIGN) * len(layers)
        return total * cfg.num_experts

    options = {
        "experts": kind,
        "group": group,
        "down_group": down_group,
        "delta": delta,
        "overrides": list(overrides),
    }
    return convert(
        src,
        dst,
        force=force,
        progress=progress,
        finish=finish,
        keep_fp4_codes=keep_codes,
        dense=dense,
        tokenizer=tokenizer,
        options=options,
        finish_bytes=None if keep_codes and kind == source_fp4 else finish_bytes,
    )
