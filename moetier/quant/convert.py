"""`moetier convert`: a Hugging Face MoE checkpoint (safetensors) -> a moetier store.

Checkpoint names are mapped to model names by transformers' own conversion mapping for the
model type (the same renames `from_pretrained` applies), on a model built on the meta device;
routed-expert tensors are recognised whether stored per expert (`experts.{e}.gate_proj.weight`,
Mixtral's `w1/w2/w3`) or fused 3-D (`experts.gate_up_proj`, gpt-oss transposed/interleaved with
biases). Quantized checkpoints (FP8, MXFP4, NVFP4) are read through quant/sources.py: their
weights are dequantised, or their FP4 codes kept as they are. Everything is streamed tensor by
tensor, read from the shards with explicit preads (no mmap, so resident memory stays near one
tensor), into the work folder `.{dst}.convert` (quant/work_folder.py:
each tensor and blob committed to its journal, so the same command resumes an interrupted run),
whose store is renamed into place at the end.

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
import fnmatch
import json
import math
import os
import re
import shutil
import struct
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from tqdm import tqdm

from moetier.config import ModelConfig, read_json
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
    CHECKPOINT_FIX,
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
    TOKENIZER_GLOBS,
    blob_index_entry,
    file_records,
    safetensors_header,
    store_folder_for,
    tokenizer_files,
)
from moetier.quant.work_folder import (
    SETTINGS_FILE,
    DestinationLock,
    Journal,
    clean_dead_folders,
    fault,
    open_work_folder,
    say,
    say_stopped,
    write_text,
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
    """A checkpoint shard's safetensors header (store.safetensors_header: every tensor's
    record checked and within the file); ConvertError naming the shard where it is not."""
    try:
        return safetensors_header(path)
    except (OSError, ValueError) as err:
        raise ConvertError(
            f"{err}: the shard is cut short, damaged or not a safetensors file; download it again"
        ) from None


def find_shards(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index, CHECKPOINT_FIX)["weight_map"].values()))
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
    config = read_json(src / "config.json", CHECKPOINT_FIX)
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in FLOAT_DTYPES else "bfloat16"


def plan_conversion(src: Path) -> ConversionPlan:
    """Read headers only and decide where every checkpoint tensor goes; raise on any gap."""
    if (src / INDEX_FILE).is_file():
        raise ConvertError(
            f"{src} is already a moetier store ({INDEX_FILE} is there): generate, serve or bench "
            "it as it is. `moetier convert` reads a Hugging Face checkpoint folder"
        )
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
    hf_config = read_json(src / "config.json", CHECKPOINT_FIX)
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
    """Writes a safetensors file tensor by tensor (the header is known up front). `resume`
    (tensors already written, end offset in the file) continues a file cut after them."""

    def __init__(
        self,
        path: Path,
        specs: list[tuple[str, str, tuple[int, ...]]],
        resume: tuple[int, int] | None = None,
    ) -> None:
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
        self.order = [s[0] for s in specs]
        self.nbytes = 8 + len(raw) + offset
        self.file: BinaryIO
        if resume is not None and resume[0] > 0:
            self.file = open(path, "r+b")  # noqa: SIM115 - closed in close()
            self.file.truncate(resume[1])
            self.file.seek(resume[1])
            self.written = resume[0]
        else:
            self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
            self.file.write(struct.pack("<Q", len(raw)) + raw)
            self.written = 0

    def write(self, name: str, tensor: torch.Tensor, crc: int = 0) -> int:
        """Append `name`'s bytes; returns the crc32 of the bytes `crc` covers and these."""
        if name != self.order[self.written]:
            raise RuntimeError(
                f"safetensors writer: expected {self.order[self.written]}, got {name}"
            )
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        self.file.write(data)
        self.written += 1
        return zlib.crc32(data, crc)

    def commit(self) -> int:
        """Flush what was written to the operating system; returns the end offset."""
        self.file.flush()
        return self.file.tell()

    def close(self) -> None:
        self.file.close()


WORK_SUFFIX = ".convert"
JOURNAL_FILE = "journal.jsonl"
STORE_DIR = "store"
RAW_EXPERTS = "experts.raw.bin"  # the unquantized experts kept (hard link) while `finish` runs
RAW_INDEX = "experts.raw.json"
INDEX_BYTES_PER_BLOB = 512  # an upper bound of one blob's record in experts.json


def work_path(dst: Path) -> Path:
    """The work folder of a conversion into `dst`: the same for every run into `dst`, so a rerun
    of the same command finds it (settings.json says what it was written under)."""
    return dst.parent / f".{dst.name}{WORK_SUFFIX}"


# The names of what a store folder holds (quant/store.py): its index, experts and dense files
# (with the temporary and side files of their writers: experts.bin.q2s ...), the files copied
# from the checkpoint (and TOKENIZER_GLOBS, from a --tokenizer folder), the tables later verbs
# write beside (gate_hot.json ...). --force replaces a folder that holds nothing else and one of
# STORE_MARKERS, or nothing at all.
STORE_NAMES = ("experts.*", DENSE_FILE, *(f"*{s}" for s in AUX_SUFFIXES), *AUX_NAMES)
STORE_MARKERS = (INDEX_FILE, EXPERTS_FILE, DENSE_FILE)


class DestinationChanged(ConvertError):
    """Files that are not a store's appeared in the destination while the conversion ran: the
    finished store is kept in the work folder, not published over them."""


def check_destination(
    src: str | Path, dst: str | Path, force: bool = False, resuming: bool = False
) -> None:
    """Refuse, before any work, an output folder that converting `src` must not write: the
    checkpoint's own folder or one holding it or any of its files (publishing replaces the
    folder whole), a file, a symbolic link, a folder holding anything but a moetier store (or
    what is left of one); and any existing folder unless `force` or `resuming` (a rerun of a
    conversion whose work folder is there)."""
    src, dst = Path(src), Path(dst).absolute()
    if not dst.exists() and not dst.is_symlink():
        return
    held = _source_inside(src, dst)
    if held is not None:
        what = (
            "is the checkpoint folder being converted"
            if dst.resolve() == src.resolve()
            else f"holds the checkpoint being converted ({held})"
        )
        raise ConvertError(
            f"{dst} {what}: the store goes into a folder of its own, e.g. {store_folder_for(src)}"
        )
    problem = _replace_problem(dst)
    if problem is not None and not dst.is_dir():
        raise ConvertError(f"{dst} {problem}: choose another output folder, or remove it yourself")
    if problem is not None:
        raise ConvertError(
            f"{dst} {problem}; --force replaces only a moetier store or an empty folder. "
            "Choose another output folder, or remove it yourself"
        )
    if not force and not resuming:
        raise ConvertError(
            f"{dst} already exists: choose another directory or pass --force to replace it"
        )


def _source_inside(src: Path, dst: Path) -> Path | None:
    """The checkpoint folder `src`, or the first of its files, that is `dst` or lies inside it
    (links followed: a Hub snapshot's files point into the Hub cache's blobs); None if none."""
    if not src.is_dir():
        return None
    root = dst.resolve()
    for path in [src, *sorted(p for p in src.iterdir() if p.is_file())]:
        real = path.resolve()
        if real == root or root in real.parents:
            return path
    return None


def _replace_problem(dst: Path) -> str | None:
    """Why replacing the existing `dst` would lose something that is not a moetier store's, as
    the end of a sentence naming `dst`; None for an empty folder or a store's files alone."""
    if dst.is_symlink():
        return "is a symbolic link, not a folder"
    if not dst.is_dir():
        return "is a file, not a folder"
    entries = sorted(dst.iterdir())
    names = (*STORE_NAMES, *TOKENIZER_GLOBS)
    foreign = [
        p.name + "/" if p.is_dir() else p.name
        for p in entries
        if p.is_dir() or not any(fnmatch.fnmatchcase(p.name, g) for g in names)
    ]
    if not foreign and entries and not any((dst / m).is_file() for m in STORE_MARKERS):
        foreign = [p.name for p in entries]  # a store's names, but no store's files
    if not foreign:
        return None
    shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    return f"is not a moetier store: it holds {shown}"


def publish(store: Path, dst: Path) -> None:
    """Rename the finished `store` to `dst`, replacing the store or empty folder there; files
    that appeared there meanwhile are not removed (DestinationChanged, `store` kept)."""
    if dst.exists() or dst.is_symlink():
        problem = _replace_problem(dst)
        if problem is not None:
            raise DestinationChanged(
                f"{dst} {problem} (put there while the conversion ran): the finished store is "
                f"kept in {store}. Move that away, then run the same command again to publish it"
            )
        shutil.rmtree(dst)
    os.replace(store, dst)


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    force: bool = False,
    progress: bool = True,
    finish: Callable[[Path], None] | None = None,
    keep_fp4_codes: bool = True,
    dense: DensePolicy | None = None,
    tokenizer: str | Path | None = None,
    options: dict[str, Any] | None = None,
    finish_bytes: Callable[[ConversionPlan], int] | None = None,
) -> Path:
    """Convert the HF checkpoint in `src` into a moetier store at `dst`; returns `dst`.

    Experts of an FP4 checkpoint (NVFP4, MXFP4) keep their codes and block scales (store format
    nvfp4 / mxfp4) unless `keep_fp4_codes` is False; other quantized weights are dequantised.
    `finish(tmp_store)` runs on the complete store before it is renamed into place (e.g.
    re-encoding the experts in a low-bit format); `options` name what it depends on (a work
    folder written under other options is not resumed), `finish_bytes(plan)` the bytes it
    writes at its peak (the free-space check). A failure there leaves nothing behind.
    `dense` chooses the format of each dense class (quant/dense_formats.py; default: as the
    checkpoint has them, FP8 dequantised). `tokenizer`: a folder whose tokenizer and chat
    template files replace the checkpoint's.

    The store is built in the work folder `.{dst}.convert` beside `dst` (work_path), each dense
    tensor and expert blob committed to its journal once written; an interrupted run (signal,
    kill, full disk) leaves the folder, and the same call resumes it, writing only what is
    missing, into a store byte-identical to an uninterrupted run's."""
    src, dst = Path(src), Path(dst).absolute()
    work = work_path(dst)
    check_destination(src, dst, force, resuming=work.exists())
    plan = plan_conversion(src)
    cfg = plan.model_config
    dims = (cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias)
    fp4 = plan.expert_fp4 if keep_fp4_codes else None
    if fp4 is not None:
        fmt = fp4_expert_format(fp4, *dims, bias_dtype=plan.expert_dtype)
    else:
        fmt = raw_expert_format(plan.expert_dtype, *dims)
    policy = dense or DensePolicy()
    if tokenizer is not None and not tokenizer_files(Path(tokenizer)):
        raise ConvertError(f"--tokenizer {tokenizer}: no tokenizer files there")
    say_unfit_dense(plan, policy)
    settings = {
        "moetier": _version(),
        "source": str(src.resolve()),
        "source_files": _source_identity(src),
        "destination": str(dst),
        "experts": fmt.name,
        "dense": policy.to_json(),
        "tokenizer": str(Path(tokenizer).resolve()) if tokenizer is not None else None,
        "finish": options if finish is not None else None,
    }
    with DestinationLock(dst):
        for path in clean_dead_folders(dst):
            say(f"removed {path}, the work folder of a conversion whose process is gone")
        if _published_before(work, dst, settings):
            return dst
        check_destination(src, dst, force)  # again, now that no other conversion writes it
        resumed = open_work_folder(work, settings)
        journal = Journal(work / JOURNAL_FILE)
        written: dict[str, int] = {}  # what this run wrote: dense tensors, expert blobs
        planned = _planned_bytes(src, plan, fmt, policy, tokenizer)
        planned += finish_bytes(plan) if finish is not None and finish_bytes else 0
        try:
            _check_free_space(work, dst, planned)
        except ConvertError:
            journal.close()
            if not resumed:  # a resumable folder stays for when there is room
                shutil.rmtree(work)
            raise
        try:
            _build(src, plan, fmt, policy, work, journal, progress, tokenizer, resumed,
                   finish, fp4, written)  # fmt: skip
            journal.commit({"stage": "publish"})
            fault("publish")
            publish(work / STORE_DIR, dst)
            fault("published")
        except (KeyboardInterrupt, OSError) as err:
            journal.close()
            if resumed:
                _say_written(written)
            say_stopped(err, work)
            raise
        except DestinationChanged:  # the finished store stays in the work folder
            journal.close()
            raise
        except BaseException:
            journal.close()
            shutil.rmtree(work, ignore_errors=True)
            raise
        journal.close()
        shutil.rmtree(work)
    return dst


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moetier")
    except PackageNotFoundError:
        return "unknown"


def _source_identity(src: Path) -> list[list[Any]]:
    """What of the checkpoint a resumed run must find unchanged: config.json and each shard's
    name, size and modification time."""
    files = [src / "config.json", *find_shards(src)]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _published_before(work: Path, dst: Path, settings: dict[str, Any]) -> bool:
    """A run with these settings published `dst` and was stopped before removing its work
    folder: remove it now; True when there is nothing left to do."""
    if not work.is_dir() or (work / STORE_DIR).exists() or not dst.exists():
        return False
    try:
        same = json.loads((work / SETTINGS_FILE).read_text()) == json.loads(json.dumps(settings))
    except (OSError, ValueError):
        same = False
    journal = Journal(work / JOURNAL_FILE)
    published = journal.has_stage("publish")
    journal.close()
    if not (same and published):
        return False
    shutil.rmtree(work)
    say(f"{dst} was converted by an earlier run; removed its leftover work folder")
    return True


def _planned_bytes(
    src: Path, plan: ConversionPlan, fmt: BlobFormat, policy: DensePolicy, tokenizer: Any
) -> int:
    """An upper estimate of what the conversion writes: auxiliary files, dense.safetensors
    (sizes from the plan), experts.bin, experts.json."""
    blobs = _n_experts(plan) * plan.model_config.num_experts
    experts = blobs * align_up(fmt.nbytes, BLOB_ALIGN)
    return planned_store_bytes(src, plan, policy, tokenizer) + experts


def planned_store_bytes(
    src: Path, plan: ConversionPlan, policy: DensePolicy, tokenizer: Any = None
) -> int:
    """What a store of `plan` holds besides experts.bin (an upper estimate): the files copied
    from the checkpoint, dense.safetensors in `policy`'s formats, experts.json."""
    aux = sum(p.stat().st_size for p in _aux_sources(src, tokenizer))
    dense = 8 + 1024
    for name, dtype, shape in _dense_specs(plan, policy)[0]:  # bytes, and the header's record
        dense += DTYPES[dtype].itemsize * math.prod(shape) + 128 + len(name)
    blobs = _n_experts(plan) * plan.model_config.num_experts
    return aux + dense + blobs * INDEX_BYTES_PER_BLOB


def _check_free_space(work: Path, dst: Path, planned: int) -> None:
    store = work / STORE_DIR
    present = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    check_free_space(work, dst, planned - present)


def check_free_space(where: Path, dst: Path, needed: int) -> None:
    """ConvertError naming the bytes when the disk holding `where` has fewer than `needed` free
    (the bytes a conversion into `dst` still writes)."""
    needed = max(0, needed)
    free = shutil.disk_usage(where).free
    if needed > free:
        raise ConvertError(
            f"not enough free disk space to convert into {dst}: it needs {needed:,} bytes "
            f"({needed / 2**30:.2f} GiB) more, {free:,} bytes ({free / 2**30:.2f} GiB) are "
            f"available on {where.parent}. Free some space or choose another directory."
        )


def _n_experts(plan: ConversionPlan) -> int:
    return len({**plan.experts, **plan.mtp_experts})


def _build(
    src: Path,
    plan: ConversionPlan,
    fmt: BlobFormat,
    policy: DensePolicy,
    work: Path,
    journal: Journal,
    progress: bool,
    tokenizer: Any,
    resumed: bool,
    finish: Callable[[Path], None] | None,
    fp4: str | None,
    written: dict[str, int],
) -> None:
    """Every stage of a conversion not yet in `journal`, in order, each committed there;
    `written` counts the dense tensors and expert blobs this run writes."""
    store = work / STORE_DIR
    store.mkdir(exist_ok=True)
    if journal.has_stage("finish-start") and not journal.has_stage("finish"):
        _undo_finish(work, store, journal)
    if resumed:  # the pieces of the stage in progress whose bytes still match are kept
        if not journal.has_stage("dense"):
            _verified(store / DENSE_FILE, journal, "dense", sorted(plan.dense))
        if not journal.has_stage("experts"):
            n_blobs = _n_experts(plan) * plan.model_config.num_experts
            _verified(store / EXPERTS_FILE, journal, "blob", list(range(n_blobs)))
        dense_done = len(journal.of("dense"))
        blobs_done = len(journal.of("blob"))
        say(
            f"resuming the conversion in {work}: {dense_done} of {len(plan.dense)} dense "
            f"tensors and {blobs_done} of {_n_experts(plan) * plan.model_config.num_experts} "
            "expert blobs were written by an earlier run and are kept"
        )
    if not journal.has_stage("aux"):
        _copy_aux_files(src, store, tokenizer)
        journal.commit({"stage": "aux"})
        fault("aux")
    dense_tensors = _write_dense(plan, store / DENSE_FILE, progress, policy, journal, written)
    if not journal.has_stage("dense"):
        journal.commit({"stage": "dense"})
    blobs = _write_experts(plan, fmt, store / EXPERTS_FILE, progress, journal, written)
    if not journal.has_stage("experts"):
        journal.commit({"stage": "experts"})
    if not journal.has_stage("index"):
        index = store_index(plan, [fmt], blobs, policy, dense_tensors)
        index["files"] = file_records(store)  # dense.safetensors' checksums (quant/verify.py)
        if fp4 is not None:
            index["quantization"] = {"experts": fp4, "codes": "source"}
        write_text(store / INDEX_FILE, json.dumps(index, indent=1))
        journal.commit({"stage": "index"})
        fault("index")
    if finish is not None and not journal.has_stage("finish"):
        _run_finish(finish, work, store, journal)
    if resumed:
        _say_written(written)


def _say_written(written: dict[str, int]) -> None:
    say(
        f"this run wrote {written.get('dense', 0)} dense tensors and "
        f"{written.get('blob', 0)} expert blobs"
    )


def _run_finish(finish: Callable[[Path], None], work: Path, store: Path, journal: Journal) -> None:
    """`finish(store)` (re-encoding the experts in place) on the unquantized store, whose
    experts and index are kept beside (a hard link, no copy) until it returns: a run stopped
    inside it starts it again from them (_undo_finish)."""
    raw, raw_index = work / RAW_EXPERTS, work / RAW_INDEX
    raw.unlink(missing_ok=True)
    try:
        os.link(store / EXPERTS_FILE, raw)
        shutil.copyfile(store / INDEX_FILE, raw_index)
    except OSError:  # no hard links here: a resumed run redoes the experts
        raw.unlink(missing_ok=True)
    journal.commit({"stage": "finish-start"})
    fault("finish")
    finish(store)
    fault("finished")
    journal.commit({"stage": "finish"})
    raw.unlink(missing_ok=True)
    raw_index.unlink(missing_ok=True)


def _undo_finish(work: Path, store: Path, journal: Journal) -> None:
    """A run stopped inside `finish`: the unquantized experts and index back in place (what
    `finish` wrote beside them stays: requantize_experts resumes from its own journal), or,
    where they could not be kept, the experts to be written again."""
    raw, raw_index = work / RAW_EXPERTS, work / RAW_INDEX
    (store / EXPERTS_FILE).unlink(missing_ok=True)
    if raw.exists() and raw_index.exists():
        os.link(raw, store / EXPERTS_FILE)
        shutil.copyfile(raw_index, store / INDEX_FILE)
        say("the last run stopped while re-encoding the experts: going on from the kept ones")
        journal.rewrite([r for r in journal.records if r.get("stage") != "finish-start"])
        return
    for path in store.glob("experts.*"):
        path.unlink()
    say("writing the experts again: the last run stopped while re-encoding them")
    dropped = ("finish-start", "experts", "index")
    journal.rewrite(
        [r for r in journal.records if r.get("stage") not in dropped and "blob" not in r]
    )


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


def _aux_sources(src: Path, tokenizer: str | Path | None = None) -> list[Path]:
    """The files copied into the store beside config.json: the checkpoint's, then those of the
    `tokenizer` folder (which win)."""
    files = [
        p
        for p in sorted(src.iterdir())
        if p.is_file()
        and p.name not in SKIP_AUX
        and (p.suffix in AUX_SUFFIXES or p.name in AUX_NAMES)
    ]
    if tokenizer is not None:
        extra = tokenizer_files(Path(tokenizer))
        names = {p.name for p in extra}
        files = [p for p in files if p.name not in names] + extra
    return files


def _copy_aux_files(src: Path, dst: Path, tokenizer: str | Path | None = None) -> None:
    # The store's weights are dequantised or in moetier's own formats: transformers must not
    # apply the source's quantization when it builds the model from this config.
    config = read_json(src / "config.json", CHECKPOINT_FIX)
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in _aux_sources(src, tokenizer):
        shutil.copyfile(path, dst / path.name)


def say_unfit_dense(plan: ConversionPlan, policy: DensePolicy) -> None:
    """Say which dense weights `policy` would quantize but must leave unquantized (their K is
    not in whole groups of the format): the store then differs from what --dense asked."""
    unfit = policy.unfit({name: t.shape for name, t in plan.dense.items()})
    if unfit is not None:
        say(f"--dense {unfit}")


def _dense_specs(
    plan: ConversionPlan, policy: DensePolicy
) -> tuple[list[tuple[str, str, tuple[int, ...]]], dict[str, DenseFormat]]:
    """dense.safetensors' tensors in file order, and the format of each quantized weight."""
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
    return specs, formats


def _write_dense(
    plan: ConversionPlan,
    path: Path,
    progress: bool,
    policy: DensePolicy,
    journal: Journal | None = None,
    written: dict[str, int] | None = None,
) -> dict[str, Any]:
    """dense.safetensors: each tensor as the checkpoint has it (FP8 dequantised), or in the
    format `policy` gives its class, with its scales; an FP8 source's weight and scales are
    copied bit for bit where its class asks for fp8. Returns the index's record of the
    quantized weights: module name -> format, class and [N, K].

    With a `journal`, each tensor is committed there once written; the tensors it holds whose
    bytes still match are not written again (`written["dense"]` counts those that are)."""
    specs, formats = _dense_specs(plan, policy)
    record = {
        name[: -len(".weight")]: {
            "format": fmt.to_json(),
            "class": dense_class(name),
            "shape": list(plan.dense[name].shape),
        }
        for name, fmt in formats.items()
    }
    names = sorted(plan.dense)
    if journal is not None and journal.has_stage("dense"):
        return record
    resume = None
    if journal is not None and journal.of("dense"):  # checked by _build (_verified)
        last = journal.of("dense")[-1]
        resume = (last["specs"], last["end"])
    writer = _SafetensorsWriter(path, specs, resume)
    done = len(journal.of("dense")) if journal is not None else 0
    read = TensorReader(plan.quantization)
    try:
        for name in tqdm(names[done:], desc="dense tensors", disable=not progress,
                         unit="tensor", initial=done, total=len(names)):  # fmt: skip
            t, fmt = plan.dense[name], formats.get(name)
            if fmt is None:
                crc = writer.write(name, read(t))
            else:
                if fmt.source:  # the checkpoint's own FP8 weight and tile scales
                    parts = [read.raw(t.parts["weight"]), read.raw(t.parts["scale"]).float()]
                else:
                    parts = fmt.quantize(read(t))
                crc = 0
                for (part_name, dtype, shape), tensor in zip(
                    fmt.tensors(name, t.shape), parts, strict=True
                ):
                    if tensor.dtype != DTYPES[dtype] or tuple(tensor.shape) != shape:
                        raise ConvertError(
                            f"{name}: {part_name} is {tensor.dtype} {tuple(tensor.shape)}, the "
                            f"{fmt.name} format needs {dtype} {shape}"
                        )
                    crc = writer.write(part_name, tensor, crc)
            end = writer.commit()
            if journal is not None:
                journal.commit({"dense": name, "specs": writer.written, "end": end, "crc32": crc})
                done += 1
                if written is not None:
                    written["dense"] = written.get("dense", 0) + 1
                fault("dense", done)
    finally:
        read.close()
        writer.close()
    return record


def _verified(path: Path, journal: Journal, kind: str, names: list[Any]) -> list[dict[str, Any]]:
    """The journal's `kind` records, in order, whose bytes in `path` still have their crc32;
    the rest are dropped from the journal. A dense record covers the bytes after the previous
    one's end (the first: after the header), an experts record its blob's stride."""
    records = journal.of(kind)
    kept: list[dict[str, Any]] = []
    if records and path.exists():
        with open(path, "rb") as f:
            for i, r in enumerate(records):
                if i >= len(names) or r[kind] != names[i]:
                    break
                if kind == "dense":
                    if kept:
                        begin = kept[-1]["end"]
                    else:
                        begin = 8 + struct.unpack("<Q", f.read(8).ljust(8, b"\0"))[0]
                    f.seek(begin)
                    data = f.read(max(0, r["end"] - begin))
                    whole = len(data) == r["end"] - begin
                else:
                    f.seek(r["offset"])
                    data = f.read(r["stride"])
                    whole = len(data) == r["stride"]
                if not whole or zlib.crc32(data) != r["crc32"]:
                    break
                kept.append(r)
    if len(kept) != len(records):
        journal.rewrite([r for r in journal.records if kind not in r] + kept)
    return kept


def _write_experts(
    plan: ConversionPlan,
    fmt: BlobFormat,
    path: Path,
    progress: bool,
    journal: Journal | None = None,
    written: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """experts.bin, one blob per (layer, expert) at a fixed stride; returns their index records.
    With a `journal`, each blob is committed there once written, and those it holds whose bytes
    still match are not computed again (`written["blob"]` counts the blobs that are)."""
    n_exp = plan.model_config.num_experts
    stride = align_up(fmt.nbytes, BLOB_ALIGN)
    read = TensorReader(plan.quantization)
    canonical = canonical_fp4_expert if format_kind(fmt) != "raw" else canonical_expert
    modules = {**plan.experts, **plan.mtp_experts}  # MTP layers after the main stack's
    keys = [(layer, e) for layer in sorted(modules) for e in range(n_exp)]
    blobs: list[dict[str, Any]] = []
    mode = "wb"
    if journal is not None:
        if journal.has_stage("experts"):
            return [r["entry"] for r in journal.of("blob")]
        blobs = [r["entry"] for r in journal.of("blob")]  # checked by _build (_verified)
        mode = "r+b" if blobs else "wb"
    with open(path, mode) as f, contextlib.closing(read):
        f.truncate(len(blobs) * stride)
        f.seek(len(blobs) * stride)
        for i in tqdm(range(len(blobs), len(keys)), desc="experts", disable=not progress,
                      unit="expert", initial=len(blobs), total=len(keys)):  # fmt: skip
            layer, e = keys[i]
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
            data = blob.numpy().tobytes()
            f.write(data)
            entry = blob_index_entry(layer, e, i * stride, fmt, blob)
            blobs.append(entry)
            if journal is not None:
                f.flush()
                journal.commit(
                    {"blob": i, "offset": i * stride, "stride": stride,
                     "crc32": zlib.crc32(data), "entry": entry}
                )  # fmt: skip
                if written is not None:
                    written["blob"] = written.get("blob", 0) + 1
                fault("experts", i + 1)
    return blobs
