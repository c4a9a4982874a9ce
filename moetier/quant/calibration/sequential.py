"""Calibrated conversion layer by layer (`moetier convert --experts q2s --calibration TEXT`).

The calibration tokens' hidden states go through the checkpoint's model one decoder layer at a
time (quant/calibration/layer_pass.py: attention and router from the source weights); at a MoE
layer its experts' inputs are recorded, the experts are read from the source shards, quantized
with statistics of those inputs (layer_experts.py: GPTQ Hessians or diagonal importance, one
layer at a time, a chunk of experts at a time) and the layer run again with the quantized
experts' output, which feeds the next layer. Nothing but the output store is written at full
size: no intermediate unquantized store. Each finished layer is committed to the work folder
(workdir.py), so a killed conversion resumes at the next layer.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moetier.core.layout import BlobFormat, MatrixCodec, align_up, coded_expert_format
from moetier.quant.calibration.layer_experts import (
    MODES,
    TARGETS,
    LayerInputs,
    LayerPlan,
    bytes_per_expert,
    quantize_layer,
)
from moetier.quant.calibration.layer_pass import LayerPass
from moetier.quant.calibration.workdir import WorkFolder
from moetier.quant.convert import (
    ConversionPlan,
    _copy_aux_files,
    _write_dense,
    check_destination,
    check_free_space,
    dequantized_dtype,
    plan_conversion,
    planned_store_bytes,
    publish,
    say_unfit_dense,
    store_index,
)
from moetier.quant.dense_formats import DensePolicy
from moetier.quant.requantize import Q2_DELTA, Override, layer_codecs
from moetier.quant.sources import ConvertError, TensorReader
from moetier.quant.store import (
    BLOB_ALIGN,
    EXPERTS_FILE,
    INDEX_FILE,
    blob_index_entry,
    file_records,
)
from moetier.quant.work_folder import said_when_stopped

CTX = 512  # tokens per calibration sequence
BATCH = 4  # sequences per forward


def calibration_texts(path: Path) -> list[str]:
    """A .txt file, or every .txt file of a directory (sorted)."""
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"no .txt calibration text in {path}")
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(
                f"calibration file {f} is not UTF-8 text ({err.reason} at byte {err.start}): "
                "convert it to UTF-8, or pass plain text files"
            ) from None
    return texts


def calibration_ids(tokenizer: Any, texts: list[str], max_tokens: int, ctx: int) -> torch.Tensor:
    """[n, ctx] token ids: an equal share from the start of every text, so all are seen."""
    share = -(-max_tokens // len(texts))
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text[: share * 8], add_special_tokens=False)[:share])
    n = min(len(ids), max_tokens) // ctx
    if n == 0:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    return torch.tensor(ids[: n * ctx]).view(n, ctx)


def convert_calibrated(
    src: str | Path,
    dst: str | Path,
    calibration: str | Path,
    *,
    tokens: int = 65536,
    mode: str = "gptq",
    group: int = 32,
    down_group: int = 16,
    delta: str | None = None,
    overrides: Sequence[Override] = (),
    force: bool = False,
    progress: bool = True,
    dense: DensePolicy | None = None,
    device: str | None = None,
    chunk_bytes: int | None = None,
    ctx: int = CTX,
    target: str = "quantized",
    refine: int = 0,
) -> Path:
    """Convert `src` into a store at `dst` with q2s experts (other codecs where `overrides`
    say), rounded with statistics of `calibration` text carried through the quantized model."""
    if mode not in MODES:
        raise ValueError(f"--calibration-mode {mode!r}: choose {' or '.join(MODES)}")
    if target not in TARGETS:
        raise ValueError(f"--calibration-target {target!r}: choose {' or '.join(TARGETS)}")
    if tokens < ctx:
        raise ValueError(
            f"--calibration-tokens {tokens} is less than one calibration sequence of {ctx} "
            f"tokens: pass at least {ctx}"
        )
    src, dst = Path(src), Path(dst).absolute()
    check_destination(src, dst, force)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan = plan_conversion(src)
    cfg = plan.model_config
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    chunks = calibration_ids(tokenizer, calibration_texts(Path(calibration)), tokens, ctx)
    policy = dense or DensePolicy()
    say_unfit_dense(plan, policy)
    settings = {
        "source": str(src.resolve()),
        "experts": "q2s",
        "mode": mode,
        "target": target,
        "refine": refine,
        "group": group,
        "down_group": down_group,
        "delta": delta,
        "overrides": [repr(o) for o in overrides],
        "dense": policy.to_json(),
        "tokens": hashlib.sha256(chunks.numpy().tobytes()).hexdigest(),
        "ctx": ctx,
        "batch": BATCH,
        "device": dev.type,
    }
    work = WorkFolder(dst.parent / f".{dst.name}.calibration", settings)
    expert_layers = sorted({**plan.experts, **plan.mtp_experts})
    codecs = layer_codecs("q2s", group, down_group, overrides, expert_layers)
    dims = (cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias)
    delta_codec = {"nvfp4": MatrixCodec.parse("nvfp4"), "q2": Q2_DELTA}.get(delta or "")
    delta_fmt = None
    if delta_codec is not None:
        delta_fmt = coded_expert_format(delta_codec, delta_codec, *dims[:2], False)
    plans = {
        layer: LayerPlan(
            coded_expert_format(c["gate_up"], c["down"], *dims, bias_dtype=plan.expert_dtype),
            c,
            mode,
            cfg.activation,
            delta_fmt,
            delta_codec,
            refine,
            target,
        )
        for layer, c in codecs.items()
    }
    dtype = torch.float32
    if dev.type == "cuda":
        dtype = getattr(torch, dequantized_dtype(src) if plan.quantization else plan.expert_dtype)
    _check_space(src, plan, plans, policy, chunks, dtype, work, dst)
    with said_when_stopped(work.path):  # the same command resumes after the last layer done
        if work.dense_index() is None:
            _copy_aux_files(src, work.store)
            dense_record = _write_dense(plan, work.store / "dense.safetensors", progress, policy)
            work.commit_dense(dense_record)
        dense_tensors = work.dense_index()
        assert dense_tensors is not None
        per_expert = bytes_per_expert(mode, cfg.hidden_size, cfg.expert_intermediate_size, group)
        if chunk_bytes is None:
            chunk_bytes = 2 * 2**30
            if dev.type == "cuda":
                chunk_bytes = int(torch.cuda.mem_get_info(dev)[0] * 0.4)
        chunk = max(1, min(cfg.num_experts, chunk_bytes // per_expert))
        _preflight(plan, chunks, mode, dev, dtype, chunk, per_expert, work.path)

        start = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        _run_layers(src, plan, plans, chunks, work, dev, dtype, chunk, progress)
        seconds = sum(work.record(layer).get("seconds", 0.0) for layer in work.committed())
        peak = ""
        if dev.type == "cuda":
            peak = f"; peak GPU memory {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB"
        print(
            f"calibrated {len(work.committed())} layers: {seconds:.1f} s of layer work "
            f"({time.perf_counter() - start:.1f} s in this run){peak}",
            flush=True,
        )
        _finish(plan, plans, work, dst, policy, dense_tensors, mode, group, down_group, delta,
                overrides, chunks.numel(), target, refine)  # fmt: skip
    return dst


def _check_space(
    src: Path,
    plan: ConversionPlan,
    plans: dict[int, LayerPlan],
    policy: DensePolicy,
    chunks: torch.Tensor,
    dtype: torch.dtype,
    work: WorkFolder,
    dst: Path,
) -> None:
    """Free disk for what is still to be written: the store without its experts, each layer's
    blobs twice (the layer files, then experts.bin made from them) and two layers' outputs."""
    n_exp = plan.model_config.num_experts
    blobs = 0
    for p in plans.values():
        blobs += align_up(p.fmt.nbytes, BLOB_ALIGN)
        blobs += align_up(p.delta_fmt.nbytes, BLOB_ALIGN) if p.delta_fmt is not None else 0
    outputs = 2 * chunks.numel() * plan.model_config.hidden_size * torch.finfo(dtype).bits // 8
    planned = planned_store_bytes(src, plan, policy) + 2 * blobs * n_exp + outputs
    present = sum(p.stat().st_size for p in work.path.rglob("*") if p.is_file())
    try:
        check_free_space(work.path, dst, planned - present)
    except ConvertError:
        if work.dense_index() is None and not work.committed():
            work.remove()  # nothing done yet: nothing to resume
        raise


def _preflight(
    plan: ConversionPlan,
    chunks: torch.Tensor,
    mode: str,
    dev: torch.device,
    dtype: torch.dtype,
    chunk: int,
    per_expert: int,
    work: Path,
) -> None:
    cfg = plan.model_config
    h, i, e = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    n = chunks.numel()
    width = torch.finfo(dtype).bits // 8
    layer_stats = e * ((h * h + i * i) if mode == "gptq" else (h + i)) * 4
    # layer input + its outputs, the experts' recorded inputs, their fp32 output
    activations = n * h * (3 * width + 4)
    print(
        f"calibration ({mode}) on {dev}: {n:,} tokens ({chunks.shape[0]} x {chunks.shape[1]}), "
        f"{cfg.num_layers} layers, {e} experts of {h}x{i}\n"
        f"  one layer's statistics {layer_stats / 2**30:.2f} GiB; held {chunk} experts at a time "
        f"(~{chunk * per_expert / 2**30:.2f} GiB); activations ~{activations / 2**30:.2f} GiB "
        f"({dtype}); work folder {work}",
        flush=True,
    )


def _run_layers(
    src: Path,
    plan: ConversionPlan,
    plans: dict[int, LayerPlan],
    chunks: torch.Tensor,
    work: WorkFolder,
    dev: torch.device,
    dtype: torch.dtype,
    chunk: int,
    progress: bool,
) -> None:
    cfg = plan.model_config
    done = work.committed()
    main = list(range(cfg.num_layers))
    todo = [layer for layer in [*main, *sorted(plan.mtp_experts)] if layer not in done]
    if not todo:
        return
    batches = list(chunks.split(BATCH))
    runner = LayerPass(src, plan, dev, dtype)
    read = TensorReader(plan.quantization)
    last_main = max((layer for layer in done if layer < cfg.num_layers), default=None)
    previous: list[Any] = [None] * len(batches)
    if last_main is not None and todo[0] < cfg.num_layers:
        previous = work.outputs(last_main, dev)
    bar = tqdm(total=len(todo), desc="layers", unit="layer", disable=not progress)
    try:
        for layer in todo:
            start = time.perf_counter()
            if layer >= cfg.num_layers:  # MTP layer: no calibration inputs reach it
                blobs, deltas, _ = quantize_layer(
                    plan.mtp_experts[layer], read, None, _nearest(plans[layer]),
                    cfg.num_experts, chunk, dev,
                )  # fmt: skip
                work.commit_layer(layer, _record(layer, plans[layer], start), blobs, deltas, None)
                bar.update()
                continue
            runner.materialise(layer)
            module = runner.experts_module(layer)
            blobs, deltas = [], []
            if module is None:
                outputs = [runner.run(layer, b, previous[i]) for i, b in enumerate(batches)]
            else:
                outputs, blobs, deltas = _moe_layer(
                    runner, module, read, plan, plans[layer], layer, batches, previous, dev,
                    chunk, progress,
                )  # fmt: skip
            runner.release(layer)
            last = layer == cfg.num_layers - 1
            record = _record(layer, plans.get(layer), start)
            work.commit_layer(layer, record, blobs, deltas, None if last else outputs)
            previous = outputs
            bar.update()
    finally:
        bar.close()
        read.close()
        runner.close()


def _moe_layer(
    runner: LayerPass,
    module: torch.nn.Module,
    read: TensorReader,
    plan: ConversionPlan,
    layer_plan: LayerPlan,
    layer: int,
    batches: list[torch.Tensor],
    previous: list[Any],
    dev: torch.device,
    chunk: int,
    progress: bool,
) -> tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]:
    """Record the experts' inputs, quantize the experts, run the layer with their output."""
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        seen.append((hidden.detach(), ids.detach(), weights.detach()))
        return torch.zeros_like(hidden)

    module.moetier_calibration = record  # type: ignore[assignment]
    for i, b in enumerate(batches):
        runner.run(layer, b, previous[i])
    sizes = [x.shape[0] for x, _, _ in seen]
    inputs = LayerInputs(
        torch.cat([x for x, _, _ in seen]),
        torch.cat([ids for _, ids, _ in seen]),
        torch.cat([w for _, _, w in seen]),
    )
    seen.clear()
    cfg = plan.model_config
    bar = tqdm(
        total=cfg.num_experts, desc=f"layer {layer}", unit="expert", leave=False,
        disable=not progress,
    )  # fmt: skip
    blobs, deltas, out = quantize_layer(
        plan.experts[layer], read, inputs, layer_plan, cfg.num_experts, chunk, dev, bar.update
    )
    bar.close()
    assert out is not None
    del inputs
    pieces = list(out.split(sizes))

    def replay(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return pieces.pop(0).to(hidden.dtype)

    module.moetier_calibration = replay  # type: ignore[assignment]
    outputs = [runner.run(layer, b, previous[i]) for i, b in enumerate(batches)]
    if pieces:
        raise RuntimeError(f"layer {layer}: the experts ran fewer times than when recorded")
    del module.moetier_calibration
    return outputs, blobs, deltas


def _nearest(layer_plan: LayerPlan) -> LayerPlan:
    return LayerPlan(
        layer_plan.fmt, layer_plan.codecs, None, layer_plan.act, layer_plan.delta_fmt,
        layer_plan.delta_codec, 0,
    )  # fmt: skip


def _record(layer: int, layer_plan: LayerPlan | None, start: float) -> dict[str, Any]:
    out: dict[str, Any] = {"layer": layer, "seconds": round(time.perf_counter() - start, 3)}
    if layer_plan is not None:
        out["format"] = layer_plan.fmt.name
        out["delta_format"] = layer_plan.delta_fmt.name if layer_plan.delta_fmt else None
    return out


def _finish(
    plan: ConversionPlan,
    plans: dict[int, LayerPlan],
    work: WorkFolder,
    dst: Path,
    policy: DensePolicy,
    dense_tensors: dict[str, Any],
    mode: str,
    group: int,
    down_group: int,
    delta: str | None,
    overrides: Sequence[Override],
    tokens: int,
    target: str = "quantized",
    refine: int = 0,
) -> None:
    """experts.bin (every layer's base blobs, then the delta blobs), experts.json, publish."""
    n_exp = plan.model_config.num_experts
    layers = sorted(plans)
    blobs: list[dict[str, Any]] = []
    offset = 0
    formats: dict[str, BlobFormat] = {}
    with open(work.store / EXPERTS_FILE, "wb") as f:
        for plane in ("base", "delta"):
            for layer in layers:
                fmt = plans[layer].fmt if plane == "base" else plans[layer].delta_fmt
                if fmt is None:
                    continue
                formats[fmt.name] = fmt
                stride = align_up(fmt.nbytes, BLOB_ALIGN)
                with open(work.blob_file(layer, plane), "rb") as part:
                    for e in range(n_exp):
                        raw = part.read(stride)
                        if len(raw) != stride:
                            raise RuntimeError(f"{work.path}: layer {layer} {plane} is short")
                        blob = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                        blobs.append(blob_index_entry(layer, e, offset, fmt, blob, plane))
                        f.write(raw)
                        offset += stride
    index = store_index(plan, list(formats.values()), blobs, policy, dense_tensors)
    index["files"] = file_records(work.store)  # dense.safetensors' checksums
    quant: dict[str, Any] = {
        "experts": "q2s",
        "group": group,
        "down_group": down_group,
        "rounding": mode,
        "calibration": {"mode": mode, "tokens": tokens, "sequential": True},
    }
    if target != "quantized":
        quant["calibration"]["target"] = target
    if refine:
        quant["calibration"]["refine"] = refine
    if delta is not None:
        quant["delta"] = delta
    if overrides:
        quant["overrides"] = {
            str(layer): {m: c.name for m, c in p.codecs.items()} for layer, p in plans.items()
        }
    index["quantization"] = quant
    (work.store / INDEX_FILE).write_text(json.dumps(index, indent=1))
    publish(work.store, dst)
    work.remove()
