"""`moetier convert`: a Hugging Face MoE checkpoint (safetensors) -> a moetier store.

Checkpoint names are mapped to model names by transformers' own conversion mapping for the
model type (the same renames `from_pretrained` applies), on a model built on the meta device;
routed-expert tensors are recognised whether stored per expert (`experts.{e}.gate_proj.weight`,
Mixtral's `w1/w2/w3`) or fused 3-D (`experts.gate_up_proj`, gpt-oss transposed/interleaved with
biases). Quantized checkpoints (FP8, MXFP4, NVFP4) are read through quant/sources.py: their
weights are dequantised, or their FP4 codes kept as they are. Everything is streamed tensor by
tensor, read from the shards with explicit preads (no mmap, so resident memory stays near one
tensor), and written into a temporary directory that is renamed into
place at the end.

Multi-token-prediction (MTP) layers are kept, not dropped: DeepSeek-V3 / GLM-4.5+ / GLM-5 store
them as `model.layers.{num_hidden_layers + i}` (enorm, hnorm, eh_proj, shared_head and a whole
decoder block), DeepSeek-V4 as `mtp.{i}.`, Qwen3-Next / Qwen3.5 as `mtp.` (`mtp.fc`,
`mtp.layers.{i}.`). Their routed experts become blobs of store layer num_hidden_layers + i like
any layer's; every other MTP tensor goes into dense.safetensors under its checkpoint name. The
index lists them (`mtp_layers`, `mtp_dense`) so the loaders leave them out of the main model
(docs/formats.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moetier.config import ModelConfig
from moetier.core.layout import (
    DTYPES,
    BlobFormat,
    align_up,
    format_kind,
    fp4_expert_format,
    raw_expert_format,
)
from moetier.quant.dense_formats import DenseFormat, DensePolicy, dense_class
from moetier.quant.experts_probe import ExpertsMismatch, check_model_experts
from moetier.quant.sources import (
    ConvertError,
    SourceQuantization,
    SourceTensor,
    TensorReader,
    detect_quantization,
    fold_quantized,
)
from moetier.quant.store import (
    BLOB_ALIGN,
    DENSE_FILE,
    EXPERTS_FILE,
    INDEX_FILE,
    STORE_VERSION,
    blob_index_entry,
)

SAFETENSORS_DTYPES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}
# Per-expert projection names -> role in the canonical blob.
EXPERT_ROLES = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
PER_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# MTP tensors stored apart from the decoder stack: DeepSeek-V4 `mtp.{i}.`, Qwen3-Next / Qwen3.5
# `mtp.layers.{i}.` and the shared `mtp.fc`, `mtp.norm`, `mtp.pre_fc_norm_*`
MTP_PREFIX_RE = re.compile(r"^((?:model\.)?mtp\.(?:layers\.)?)(\d+)\.|^(?:model\.)?mtp\.")
# The config keys that count a family's MTP layers
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
AUX_SUFFIXES = (".json", ".jinja", ".tiktoken", ".model")
AUX_NAMES = ("merges.txt", "vocab.txt")
# The store's config.json is rewritten without quantization_config; ModelOpt's file is not copied.
SKIP_AUX = ("model.safetensors.index.json", "hf_quant_config.json", "config.json")


@dataclass
class ExpertsModule:
    """An experts module of the meta model: where its pieces come from."""

    path: str
    layer: int
    is_transposed: bool
    is_concatenated: bool
    has_bias: bool
    # (expert, role) -> source tensor, for per-expert checkpoints
    per_expert: dict[tuple[int, str], SourceTensor] = field(default_factory=dict)
    # param name ("gate_up_proj", "down_proj", ...) -> fused source tensor [E, ...]
    fused: dict[str, SourceTensor] = field(default_factory=dict)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Parse a safetensors header and check the file holds every byte it promises."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConvertError(f"{path} is truncated (no header): download it again")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise ConvertError(f"{path} is truncated inside its header: download it again")
        header = json.loads(f.read(header_len))
    data_end = max(
        (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
    )
    if 8 + header_len + data_end > size:
        raise ConvertError(
            f"{path} is truncated: {size} bytes, its header needs {8 + header_len + data_end}. "
            "Download the shard again."
        )
    return header


def find_shards(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise ConvertError(
                f"{len(missing)} shard(s) listed in {index.name} are missing from {src}: "
                f"{', '.join(missing[:5])}. Download the complete checkpoint."
            )
        return [src / n for n in names]
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ConvertError(
            f"no *.safetensors in {src}: moetier converts safetensors checkpoints "
            "(convert .bin/.pt checkpoints with transformers' save_pretrained first)"
        )
    return shards


def scan_sources(shards: list[Path]) -> list[SourceTensor]:
    tensors = []
    for shard in shards:
        for key, info in read_safetensors_header(shard).items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ConvertError(
                    f"{shard.name}: tensor {key} has dtype {info['dtype']}; moetier converts "
                    "bf16, fp16 and fp32 checkpoints and the quantized ones of docs/formats.md"
                )
            tensors.append(
                SourceTensor(shard, key, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]))
            )
    return tensors


def build_meta_model(src: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def experts_modules(model: torch.nn.Module) -> dict[str, ExpertsModule]:
    """Every `@use_experts_implementation` module of the model, by dotted path."""
    found = {}
    for name, module in model.named_modules():
        if not hasattr(module, "is_concatenated") or not hasattr(module, "down_proj"):
            continue
        if not getattr(module, "has_gate", True):
            raise ConvertError(f"{name}: experts without a gate projection are not supported yet")
        layer = LAYER_RE.search(name + ".")
        if layer is None:
            raise ConvertError(f"cannot tell the layer of experts module {name}")
        found[name] = ExpertsModule(
            name, int(layer.group(1)), module.is_transposed, module.is_concatenated, module.has_bias
        )
    return found


def _key_mapper(model: torch.nn.Module):  # type: ignore[no-untyped-def]
    """checkpoint key -> model key, with transformers' own renames for this model type."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)

    merged: dict[str, str] = {}  # checkpoint key -> the converter pattern it matched

    def mapped(key: str) -> str:
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if target not in meta_state and key in meta_state:
            # As from_pretrained does: a key already in model form is not renamed (only prefixed).
            target, pattern = rename_source_key(key, [], [], prefix, meta_state)
        if pattern is not None:
            merged[key] = pattern
        return target

    mapped.merged = merged  # type: ignore[attr-defined]
    return mapped


@dataclass
class ConversionPlan:
    model_config: ModelConfig
    dense: dict[str, SourceTensor]  # model key (MTP tensors: checkpoint key) -> source
    experts: dict[int, ExpertsModule]  # layer -> module
    expert_dtype: str
    skipped: list[str]
    quantization: SourceQuantization | None = None
    expert_fp4: str | None = None  # "nvfp4"/"mxfp4" when every routed expert weight is FP4
    # MTP layers: store layer (num_hidden_layers + i) -> checkpoint prefix of its tensors
    mtp_layers: dict[int, str] = field(default_factory=dict)
    mtp_experts: dict[int, ExpertsModule] = field(default_factory=dict)  # store layer -> module
    mtp_dense: set[str] = field(default_factory=set)  # keys of `dense` that are MTP tensors


def mtp_layer_count(hf_config: dict[str, Any]) -> int:
    """How many MTP layers config.json declares (0 when it names none)."""
    text = hf_config.get("text_config")
    for config in (hf_config, text if isinstance(text, dict) else {}):
        for key in MTP_COUNT_KEYS:
            if config.get(key):
                return int(config[key])
    return 0


def mtp_place(key: str, num_layers: int, num_mtp: int) -> tuple[int, str] | None:
    """(store layer, checkpoint prefix of that MTP layer) when checkpoint tensor `key` belongs to
    an MTP layer, else None: `layers.{N}.` with num_layers <= N < num_layers + num_mtp, or the
    `mtp.` prefix (shared tensors such as Qwen3-Next's `mtp.fc` go with the first MTP layer)."""
    match = MTP_PREFIX_RE.match(key)
    if match is not None:
        if match.group(2) is None:
            return num_layers, "mtp."
        return num_layers + int(match.group(2)), f"{match.group(1)}{match.group(2)}."
    layer = LAYER_RE.search(key)
    if layer is not None and num_layers <= int(layer.group(1)) < num_layers + num_mtp:
        return int(layer.group(1)), key[: layer.end()].lstrip(".")
    return None


def dequantized_dtype(src: Path) -> str:
    """What quantized weights are dequantised to: config.json's dtype (bf16 for the real
    releases), bfloat16 if it names none."""
    config = json.loads((src / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in FLOAT_DTYPES else "bfloat16"


def plan_conversion(src: Path) -> ConversionPlan:
    """Read headers only and decide where every checkpoint tensor goes; raise on any gap."""
    if not (src / "config.json").is_file():
        raise ConvertError(f"{src}/config.json not found: point at a Hugging Face model directory")
    try:
        model_config = ModelConfig.from_dir(src)
    except ValueError as err:
        raise ConvertError(str(err)) from None
    shards = find_shards(src)
    quantization = detect_quantization(src)
    sources, skipped = fold_quantized(scan_sources(shards), quantization, dequantized_dtype(src))
    model = build_meta_model(src)
    try:  # the family's experts compute must be the op's (quant/experts_probe.py)
        check_model_experts(model, model_config.activation, model_config.expert_has_bias)
    except ExpertsMismatch as err:
        raise ConvertError(f"{model_config.model_type} is refused: {err}") from None
    modules = experts_modules(model)
    if not modules:
        raise ConvertError(
            f"{model_config.model_type}: the transformers model has no experts modules"
        )
    mapped = _key_mapper(model)
    meta_state = model.state_dict()
    ignore = [
        re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    ]
    experts_params = {}
    for path in modules:
        for pname in EXPERT_PARAMS:
            experts_params[f"{path}.{pname}"] = (path, pname)
    hf_config = json.loads((src / "config.json").read_text())
    num_mtp = mtp_layer_count(hf_config)
    like = next(iter(modules.values()))  # MTP experts are built by the same class
    mtp_layers: dict[int, str] = {}
    mtp_experts: dict[str, ExpertsModule] = {}
    mtp_dense: set[str] = set()

    dense: dict[str, SourceTensor] = {}
    for tensor in sources:
        target = mapped(tensor.key)
        mtp = None
        if target not in experts_params and target not in meta_state:
            mtp = mtp_place(tensor.key, model_config.num_layers, num_mtp)
        if mtp is not None:
            mtp_layers.setdefault(*mtp)
            path, _, pname = target.rpartition(".")
            if pname in EXPERT_PARAMS and path.endswith(".experts"):
                if path not in mtp_experts:
                    flags = (like.is_transposed, like.is_concatenated, like.has_bias)
                    mtp_experts[path] = ExpertsModule(path, mtp[0], *flags)
                _add_expert_tensor(mtp_experts[path], pname, tensor)
            elif tensor.key in dense:
                raise ConvertError(f"{tensor.key}: an MTP tensor named like a model tensor")
            else:
                dense[tensor.key] = tensor  # the checkpoint's own name
                mtp_dense.add(tensor.key)
        elif target in experts_params:
            path, pname = experts_params[target]
            _add_expert_tensor(modules[path], pname, tensor)
        elif target in meta_state:
            expected = tuple(meta_state[target].shape)
            if expected != tensor.shape and tensor.key in mapped.merged:
                raise ConvertError(
                    f"{model_config.model_type} is refused: transformers merges checkpoint "
                    f"tensors into {target} on load ({mapped.merged[tensor.key]} -> {expected}), "
                    "which moetier's converter does not do for dense tensors yet"
                )
            if expected != tensor.shape:
                raise ConvertError(
                    f"{tensor.key} has shape {tensor.shape} but the {model_config.model_type} "
                    f"model built from config.json expects {expected} for {target}: "
                    "config.json does not match the weights"
                )
            if target in dense:
                raise ConvertError(f"{tensor.key}: two checkpoint tensors map to {target}")
            dense[target] = tensor
        elif any(p.search(tensor.key) or p.search(target) for p in ignore):
            skipped.append(tensor.key)  # e.g. multi-token-prediction layers transformers drops too
        else:
            raise ConvertError(
                f"checkpoint tensor {tensor.key} (-> {target}) has no place in the "
                f"{model_config.model_type} model: the checkpoint and config.json disagree"
            )

    _check_dense_complete(model, dense, set(experts_params))
    if len({m.layer for m in mtp_experts.values()}) != len(mtp_experts):
        raise ConvertError(f"two experts modules in one MTP layer: {sorted(mtp_experts)}")
    expert_dtypes = set()
    expert_quant: set[str | None] = set()
    n_exp, inter, hidden = (
        model_config.num_experts,
        model_config.expert_intermediate_size,
        model_config.hidden_size,
    )
    for module in [*modules.values(), *mtp_experts.values()]:
        _check_experts_complete(module, n_exp, inter, hidden)
        expert_dtypes |= {t.dtype for t in module.per_expert.values()}
        expert_dtypes |= {t.dtype for t in module.fused.values()}
        weights = [*module.per_expert.values()]
        weights += [t for name, t in module.fused.items() if not name.endswith("_bias")]
        expert_quant |= {t.quant for t in weights}
    if not expert_dtypes <= set(FLOAT_DTYPES):
        raise ConvertError(
            f"routed experts have dtype {sorted(expert_dtypes)}; this version converts "
            "bf16, fp16 and fp32 experts"
        )
    if len(expert_dtypes) != 1:
        raise ConvertError(f"routed experts mix dtypes {sorted(expert_dtypes)}; expected one")
    fp4 = expert_quant.pop() if len(expert_quant) == 1 else None
    return ConversionPlan(
        model_config,
        dense,
        {m.layer: m for m in modules.values()},
        expert_dtypes.pop(),
        skipped,
        quantization,
        fp4 if fp4 in ("nvfp4", "mxfp4") else None,
        dict(sorted(mtp_layers.items())),
        {m.layer: m for m in mtp_experts.values()},
        mtp_dense,
    )


def _add_expert_tensor(module: ExpertsModule, pname: str, tensor: SourceTensor) -> None:
    """File one checkpoint tensor of an experts module: per expert by projection, or fused."""
    per_expert = PER_EXPERT_RE.search(tensor.key)
    if per_expert is not None:
        role = EXPERT_ROLES.get(per_expert.group(2))
        if role is None:
            raise ConvertError(f"unknown expert projection in {tensor.key}")
        module.per_expert[(int(per_expert.group(1)), role)] = tensor
    else:
        module.fused[pname] = tensor


def _check_dense_complete(
    model: torch.nn.Module, dense: dict[str, SourceTensor], experts_params: set[str]
) -> None:
    # Tied parameters share one Parameter object: any of its names being present fills it.
    groups: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups[id(param)].append(name)
    persistent = set(model.state_dict())
    buffers = [
        [name] for name, _ in model.named_buffers(remove_duplicate=False) if name in persistent
    ]
    missing = [
        names[0]
        for names in [*groups.values(), *buffers]
        if not any(n in dense or n in experts_params for n in names)
    ]
    if missing:
        raise ConvertError(
            f"{len(missing)} model tensor(s) are not in the checkpoint, e.g. {missing[:4]}: "
            "the checkpoint is incomplete or does not match config.json"
        )


def _check_experts_complete(module: ExpertsModule, n_exp: int, inter: int, hidden: int) -> None:
    needed = ["gate_up_proj", "down_proj"] + (
        ["gate_up_proj_bias", "down_proj_bias"] if module.has_bias else []
    )
    if module.fused:
        missing = [p for p in needed if p not in module.fused]
        if missing or module.per_expert:
            raise ConvertError(
                f"{module.path}: fused expert tensors incomplete (missing {missing})"
            )
        for tensor in module.fused.values():
            if tensor.shape[0] != n_exp:
                raise ConvertError(f"{tensor.key}: {tensor.shape[0]} experts, config says {n_exp}")
        return
    if module.has_bias:
        raise ConvertError(
            f"{module.path}: per-expert checkpoints with expert biases are not supported"
        )
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for e in range(n_exp):
        for role, shape in shapes.items():
            found = module.per_expert.get((e, role))
            if found is None:
                raise ConvertError(
                    f"{module.path}: expert {e} has no {role} projection in the checkpoint: "
                    "the checkpoint is incomplete"
                )
            if found.shape != shape:
                raise ConvertError(f"{found.key}: shape {found.shape}, expected {shape}")


def canonical_expert(
    module: ExpertsModule, expert: int, read: TensorReader
) -> dict[str, torch.Tensor]:
    """The canonical tensors (store docstring) of one expert."""
    if not module.fused:
        gate = read(module.per_expert[(expert, "gate")])
        up = read(module.per_expert[(expert, "up")])
        return {
            "gate_up": torch.cat([gate, up], dim=0),
            "down": read(module.per_expert[(expert, "down")]),
        }
    out = {}
    for pname, name in (
        ("gate_up_proj", "gate_up"),
        ("down_proj", "down"),
        ("gate_up_proj_bias", "gate_up_bias"),
        ("down_proj_bias", "down_bias"),
    ):
        if pname not in module.fused:
            continue
        t = read(module.fused[pname], expert)
        if module.is_transposed and t.dim() == 2:
            t = t.t()  # stored [in, out]; canonical is [out, in]
        if name.startswith("gate_up") and not module.is_concatenated:
            t = torch.cat([t[0::2], t[1::2]], dim=0)  # interleaved gate/up rows -> [gate; up]
        out[name] = t.contiguous()
    return out


def canonical_fp4_expert(
    module: ExpertsModule, expert: int, read: TensorReader
) -> dict[str, torch.Tensor]:
    """One expert's FP4 codes and scales as the checkpoint stores them, in the canonical layout
    (core/layout.fp4_expert_format names): nothing is re-quantised."""
    out: dict[str, torch.Tensor] = {}
    if not module.fused:
        gate = read.fp4(module.per_expert[(expert, "gate")])
        up = read.fp4(module.per_expert[(expert, "up")])
        down = read.fp4(module.per_expert[(expert, "down")])
        tensor_scales = (gate.tensor_scale, up.tensor_scale)
        if None not in tensor_scales and not torch.equal(*tensor_scales):  # type: ignore[arg-type]
            raise ConvertError(
                f"{module.path} expert {expert}: gate and up projections have different NVFP4 "
                f"global scales {[float(s) for s in tensor_scales if s is not None]}; "
                "the store keeps one per gate_up matrix, so these codes cannot be kept as they "
                "are. Convert with --experts q2s (dequantises first), or export the checkpoint "
                "with fused gate/up global scales (llm-compressor and ModelOpt do by default)."
            )
        pieces = {"gate_up": (gate, up), "down": (down,)}
    else:
        gate_up = read.fp4(module.fused["gate_up_proj"], expert)
        pieces = {"gate_up": (gate_up,), "down": (read.fp4(module.fused["down_proj"], expert),)}
    for name, parts in pieces.items():
        codes = torch.cat([p.codes for p in parts])  # [N, K/2]
        scales = torch.cat([p.scales for p in parts])  # [N, K/block]
        if name == "gate_up" and module.fused and not module.is_concatenated:
            # interleaved gate/up rows -> [gate; up]
            codes = torch.cat([codes[0::2], codes[1::2]])
            scales = torch.cat([scales[0::2], scales[1::2]])
        out[f"{name}.codes"], out[f"{name}.scales"] = codes, scales
        if parts[0].tensor_scale is not None:
            out[f"{name}.tensor_scale"] = parts[0].tensor_scale
    for pname, name in (("gate_up_proj_bias", "gate_up_bias"), ("down_proj_bias", "down_bias")):
        if pname in module.fused:
            bias = read(module.fused[pname], expert)
            if name == "gate_up_bias" and not module.is_concatenated:
                bias = torch.cat([bias[0::2], bias[1::2]])
            out[name] = bias
    return out


class _SafetensorsWriter:
    """Writes a safetensors file tensor by tensor (the header is known up front)."""

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in specs:
            nbytes = DTYPES[dtype].itemsize
            for d in shape:
                nbytes *= d
            header[name] = {
                "dtype": TO_SAFETENSORS[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.order = [s[0] for s in specs]
        self.written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name != self.order[self.written]:
            raise RuntimeError(
                f"safetensors writer: expected {self.order[self.written]}, got {name}"
            )
        self.file.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        self.written += 1

    def close(self) -> None:
        self.file.close()


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    force: bool = False,
    progress: bool = True,
    finish: Callable[[Path], None] | None = None,
    keep_fp4_codes: bool = True,
    dense: DensePolicy | None = None,
) -> Path:
    """Convert the HF checkpoint in `src` into a moetier store at `dst`; returns `dst`.

    Experts of an FP4 checkpoint (NVFP4, MXFP4) keep their codes and block scales (store format
    nvfp4 / mxfp4) unless `keep_fp4_codes` is False; other quantized weights are dequantised.
    `finish(tmp_store)` runs on the complete store before it is renamed into place (e.g.
    re-encoding the experts in a low-bit format); a failure there leaves nothing behind.
    `dense` chooses the format of each dense class (quant/dense_formats.py; default: as the
    checkpoint has them, FP8 dequantised)."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        raise ConvertError(
            f"{dst} already exists: choose another directory or pass --force to replace it"
        )
    plan = plan_conversion(src)
    cfg = plan.model_config
    dims = (cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias)
    fp4 = plan.expert_fp4 if keep_fp4_codes else None
    if fp4 is not None:
        fmt = fp4_expert_format(fp4, *dims, bias_dtype=plan.expert_dtype)
    else:
        fmt = raw_expert_format(plan.expert_dtype, *dims)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _copy_aux_files(src, tmp)
        dense_tensors = _write_dense(plan, tmp / DENSE_FILE, progress, dense or DensePolicy())
        blobs = _write_experts(plan, fmt, tmp / EXPERTS_FILE, progress)
        index = store_index(plan, [fmt], blobs, dense or DensePolicy(), dense_tensors)
        if fp4 is not None:
            index["quantization"] = {"experts": fp4, "codes": "source"}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
        if finish is not None:
            finish(tmp)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def store_index(
    plan: ConversionPlan,
    formats: list[BlobFormat],
    blobs: list[dict[str, Any]],
    dense: DensePolicy,
    dense_tensors: dict[str, Any],
) -> dict[str, Any]:
    """experts.json of a store converted by `plan` (without its "quantization" record)."""
    index: dict[str, Any] = {
        "version": STORE_VERSION,
        "model_type": plan.model_config.model_type,
        "source_dtype": plan.expert_dtype,
        "alignment": BLOB_ALIGN,
        "formats": {fmt.name: fmt.to_json() for fmt in formats},
        "moe_modules": {str(layer): m.path for layer, m in sorted(plan.experts.items())},
        "mtp_layers": {
            str(layer): {
                "prefix": prefix,
                "experts": plan.mtp_experts[layer].path if layer in plan.mtp_experts else None,
            }
            for layer, prefix in plan.mtp_layers.items()
        },
        "mtp_dense": sorted(plan.mtp_dense),
        "skipped_source_tensors": plan.skipped,
        "blobs": blobs,
    }
    index["dense"] = {"policy": dense.to_json(), "tensors": dense_tensors}
    if plan.quantization is not None:
        index["source_quantization"] = plan.quantization.to_json()
    return index


def _copy_aux_files(src: Path, dst: Path) -> None:
    # The store's weights are dequantised or in moetier's own formats: transformers must not
    # apply the source's quantization when it builds the model from this config.
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.name in SKIP_AUX:
            continue
        if path.suffix in AUX_SUFFIXES or path.name in AUX_NAMES:
            shutil.copyfile(path, dst / path.name)


def _write_dense(
    plan: ConversionPlan, path: Path, progress: bool, policy: DensePolicy
) -> dict[str, Any]:
    """dense.safetensors: each tensor as the checkpoint has it (FP8 dequantised), or in the
    format `policy` gives its class, with its scales; an FP8 source's weight and scales are
    copied bit for bit where its class asks for fp8. Returns the index's record of the
    quantized weights: module name -> format, class and [N, K]."""
    block = plan.quantization.block if plan.quantization is not None else None
    formats: dict[str, DenseFormat] = {}
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    for name in sorted(plan.dense):
        t = plan.dense[name]
        fmt = policy.choose(name, t.shape, block if t.quant == "fp8" else None)
        if fmt is None or not name.endswith(".weight"):
            specs.append((name, t.dtype, t.shape))
            continue
        formats[name] = fmt
        specs += fmt.tensors(name, t.shape)
    writer = _SafetensorsWriter(path, specs)
    read = TensorReader(plan.quantization)
    try:
        for name in tqdm(sorted(plan.dense), desc="dense tensors", disable=not progress,
                         unit="tensor"):  # fmt: skip
            t, fmt = plan.dense[name], formats.get(name)
            if fmt is None:
                writer.write(name, read(t))
                continue
            if fmt.source:  # the checkpoint's own FP8 weight and tile scales
                parts = [read.raw(t.parts["weight"]), read.raw(t.parts["scale"]).float()]
            else:
                parts = fmt.quantize(read(t))
            for (part_name, dtype, shape), tensor in zip(
                fmt.tensors(name, t.shape), parts, strict=True
            ):
                if tensor.dtype != DTYPES[dtype] or tuple(tensor.shape) != shape:
                    raise ConvertError(
                        f"{name}: {part_name} is {tensor.dtype} {tuple(tensor.shape)}, the "
                        f"{fmt.name} format needs {dtype} {shape}"
                    )
                writer.write(part_name, tensor)
    finally:
        read.close()
    writer.close()
    return {
        name[: -len(".weight")]: {
            "format": fmt.to_json(),
            "class": dense_class(name),
            "shape": list(plan.dense[name].shape),
        }
        for name, fmt in formats.items()
    }


def _write_experts(
    plan: ConversionPlan, fmt: BlobFormat, path: Path, progress: bool
) -> list[dict[str, Any]]:
    n_exp = plan.model_config.num_experts
    stride = align_up(fmt.nbytes, BLOB_ALIGN)
    read = TensorReader(plan.quantization)
    canonical = canonical_fp4_expert if format_kind(fmt) != "raw" else canonical_expert
    blobs = []
    modules = {**plan.experts, **plan.mtp_experts}  # MTP layers after the main stack's
    keys = [(layer, e) for layer in sorted(modules) for e in range(n_exp)]
    with open(path, "wb") as f, contextlib.closing(read):
        for i, (layer, e) in enumerate(
            tqdm(keys, desc="experts", disable=not progress, unit="expert")
        ):
            tensors = canonical(modules[layer], e, read)
            blob = torch.zeros(stride, dtype=torch.uint8)
            for spec in fmt.tensors:
                t = tensors[spec.name]
                if tuple(t.shape) != spec.shape:
                    raise ConvertError(
                        f"layer {layer} expert {e} {spec.name}: shape {tuple(t.shape)}, "
                        f"expected {spec.shape}"
                    )
                blob[spec.offset : spec.offset + spec.nbytes] = (
                    t.contiguous().view(-1).view(torch.uint8)
                )
            f.write(blob.numpy().tobytes())
            blobs.append(blob_index_entry(layer, e, i * stride, fmt, blob))
    return blobs
