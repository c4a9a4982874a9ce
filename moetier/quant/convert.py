"""`moetier convert`: a Hugging Face MoE checkpoint (safetensors) -> a moetier store.

Checkpoint names are mapped to model names by transformers' own conversion mapping for the
model type (the same renames `from_pretrained` applies), on a model built on the meta device;
routed-expert tensors are recognised whether stored per expert (`experts.{e}.gate_proj.weight`,
Mixtral's `w1/w2/w3`) or fused 3-D (`experts.gate_up_proj`, gpt-oss transposed/interleaved with
biases). Everything is streamed tensor by tensor from the memory-mapped shards and written into
a temporary directory that is renamed into place at the end.
"""

from __future__ import annotations

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
from moetier.core.layout import DTYPES, BlobFormat, align_up, raw_expert_format
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
AUX_SUFFIXES = (".json", ".jinja", ".tiktoken", ".model")
AUX_NAMES = ("merges.txt", "vocab.txt")
SKIP_AUX = ("model.safetensors.index.json",)


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message says what to do."""


@dataclass
class SourceTensor:
    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]


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
                    f"{shard.name}: tensor {key} has dtype {info['dtype']}; this version converts "
                    "bf16, fp16 and fp32 checkpoints (FP8/FP4 sources come with the low-bit "
                    "formats)"
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

    def mapped(key: str) -> str:
        target, _ = rename_source_key(key, renamings, converters, prefix, meta_state)
        if target not in meta_state and key in meta_state:
            # As from_pretrained does: a key already in model form is not renamed (only prefixed).
            target, _ = rename_source_key(key, [], [], prefix, meta_state)
        return target

    return mapped


@dataclass
class ConversionPlan:
    model_config: ModelConfig
    dense: dict[str, SourceTensor]  # model key -> source
    experts: dict[int, ExpertsModule]  # layer -> module
    expert_dtype: str
    skipped: list[str]


def plan_conversion(src: Path) -> ConversionPlan:
    """Read headers only and decide where every checkpoint tensor goes; raise on any gap."""
    if not (src / "config.json").is_file():
        raise ConvertError(f"{src}/config.json not found: point at a Hugging Face model directory")
    try:
        model_config = ModelConfig.from_dir(src)
    except ValueError as err:
        raise ConvertError(str(err)) from None
    shards = find_shards(src)
    sources = scan_sources(shards)
    model = build_meta_model(src)
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
        for pname in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            experts_params[f"{path}.{pname}"] = (path, pname)

    dense: dict[str, SourceTensor] = {}
    skipped: list[str] = []
    for tensor in sources:
        target = mapped(tensor.key)
        if target in experts_params:
            path, pname = experts_params[target]
            module = modules[path]
            per_expert = PER_EXPERT_RE.search(tensor.key)
            if per_expert is not None:
                role = EXPERT_ROLES.get(per_expert.group(2))
                if role is None:
                    raise ConvertError(f"unknown expert projection in {tensor.key}")
                module.per_expert[(int(per_expert.group(1)), role)] = tensor
            else:
                module.fused[pname] = tensor
        elif target in meta_state:
            expected = tuple(meta_state[target].shape)
            if expected != tensor.shape:
                raise ConvertError(
                    f"{tensor.key} has shape {tensor.shape} but the {model_config.model_type} "
                    f"model built from config.json expects {expected} for {target}: "
                    "config.json does not match the weights"
                )
            dense[target] = tensor
        elif any(p.search(tensor.key) or p.search(target) for p in ignore):
            skipped.append(tensor.key)  # e.g. multi-token-prediction layers transformers drops too
        else:
            raise ConvertError(
                f"checkpoint tensor {tensor.key} (-> {target}) has no place in the "
                f"{model_config.model_type} model: the checkpoint and config.json disagree"
            )

    _check_dense_complete(model, dense, set(experts_params))
    expert_dtypes = set()
    n_exp, inter, hidden = (
        model_config.num_experts,
        model_config.expert_intermediate_size,
        model_config.hidden_size,
    )
    for module in modules.values():
        _check_experts_complete(module, n_exp, inter, hidden)
        expert_dtypes |= {t.dtype for t in module.per_expert.values()}
        expert_dtypes |= {t.dtype for t in module.fused.values()}
    if not expert_dtypes <= set(FLOAT_DTYPES):
        raise ConvertError(
            f"routed experts have dtype {sorted(expert_dtypes)}; this version converts "
            "bf16, fp16 and fp32 experts"
        )
    if len(expert_dtypes) != 1:
        raise ConvertError(f"routed experts mix dtypes {sorted(expert_dtypes)}; expected one")
    return ConversionPlan(
        model_config, dense, {m.layer: m for m in modules.values()}, expert_dtypes.pop(), skipped
    )


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


def canonical_expert(module: ExpertsModule, expert: int, read) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The canonical tensors (store docstring) of one expert; `read(SourceTensor)` -> tensor."""
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
        t = read(module.fused[pname])[expert]
        if module.is_transposed and t.dim() == 2:
            t = t.t()  # stored [in, out]; canonical is [out, in]
        if name.startswith("gate_up") and not module.is_concatenated:
            t = torch.cat([t[0::2], t[1::2]], dim=0)  # interleaved gate/up rows -> [gate; up]
        out[name] = t.contiguous()
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
) -> Path:
    """Convert the HF checkpoint in `src` into a moetier store at `dst`; returns `dst`.

    `finish(tmp_store)` runs on the complete unquantized store before it is renamed into place
    (e.g. re-encoding the experts in a low-bit format); a failure there leaves nothing behind."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        raise ConvertError(
            f"{dst} already exists: choose another directory or pass --force to replace it"
        )
    plan = plan_conversion(src)
    cfg = plan.model_config
    fmt = raw_expert_format(
        plan.expert_dtype, cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias
    )
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _copy_aux_files(src, tmp)
        _write_dense(plan, tmp / DENSE_FILE, progress)
        blobs = _write_experts(plan, fmt, tmp / EXPERTS_FILE, progress)
        index = {
            "version": STORE_VERSION,
            "model_type": cfg.model_type,
            "source_dtype": plan.expert_dtype,
            "alignment": BLOB_ALIGN,
            "formats": {fmt.name: fmt.to_json()},
            "moe_modules": {str(layer): m.path for layer, m in sorted(plan.experts.items())},
            "skipped_source_tensors": plan.skipped,
            "blobs": blobs,
        }
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


def _copy_aux_files(src: Path, dst: Path) -> None:
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.name in SKIP_AUX:
            continue
        if path.suffix in AUX_SUFFIXES or path.name in AUX_NAMES:
            shutil.copyfile(path, dst / path.name)


class _Reader:
    """Reads tensors from the shards with explicit reads (no mmap): the converter's resident
    memory stays at the tensor in hand, whatever the checkpoint size (bench/convert_rss.py)."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[Any, int, dict[str, Any]]] = {}

    def __call__(self, t: SourceTensor) -> torch.Tensor:
        if t.file not in self._files:
            header = read_safetensors_header(t.file)
            f = open(t.file, "rb")  # noqa: SIM115 - one handle per shard for the conversion
            (header_len,) = struct.unpack("<Q", f.read(8))
            self._files[t.file] = (f, 8 + header_len, header)
        f, data_start, header = self._files[t.file]
        begin, end = header[t.key]["data_offsets"]
        out = torch.empty(end - begin, dtype=torch.uint8)
        f.seek(data_start + begin)
        if f.readinto(out.numpy().data) != end - begin:
            raise ConvertError(f"{t.file}: short read of {t.key}; download the shard again")
        return out.view(DTYPES[t.dtype]).view(t.shape)

    def close(self) -> None:
        for f, _, _ in self._files.values():
            f.close()


def _write_dense(plan: ConversionPlan, path: Path, progress: bool) -> None:
    names = sorted(plan.dense)
    writer = _SafetensorsWriter(
        path, [(n, plan.dense[n].dtype, plan.dense[n].shape) for n in names]
    )
    read = _Reader()
    for name in tqdm(names, desc="dense tensors", disable=not progress, unit="tensor"):
        writer.write(name, read(plan.dense[name]))
    writer.close()
    read.close()


def _write_experts(
    plan: ConversionPlan, fmt: BlobFormat, path: Path, progress: bool
) -> list[dict[str, Any]]:
    n_exp = plan.model_config.num_experts
    stride = align_up(fmt.nbytes, BLOB_ALIGN)
    read = _Reader()
    blobs = []
    keys = [(layer, e) for layer in sorted(plan.experts) for e in range(n_exp)]
    with open(path, "wb") as f:
        for i, (layer, e) in enumerate(
            tqdm(keys, desc="experts", disable=not progress, unit="expert")
        ):
            tensors = canonical_expert(plan.experts[layer], e, read)
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
    read.close()
    return blobs
