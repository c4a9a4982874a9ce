"""Where a store's bytes go under a GPU and a host memory budget, decided before loading.

Pure arithmetic over the store's index (or, for a model not converted, its config.json and an
expert format: `plan_shape`), no tensors: dense weights, the KV cache and a workspace
reserve on the GPU first; the rest of the GPU budget becomes expert slots (base planes first,
then delta planes); the host budget holds further expert blobs; the store's file on disk holds
everything. Expected traffic per token is a uniform-access model: at GPU hit rate h, each token
misses layers × top-k × (1 − h) base blobs; misses are served from host RAM in proportion of the
non-GPU blobs the host budget holds, the rest from disk.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from moetier.config import ModelConfig
from moetier.core.layout import TENSOR_ALIGN, BlobFormat, align_up
from moetier.quant.dense_formats import DensePolicy
from moetier.quant.store import Store
from moetier.residency.zero_copy import staging_slots

WORKSPACE_BYTES = 512 * 2**20  # activations, kernel scratch, CUDA context headroom
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
          "gib": 2**30, "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'24GiB', '24G' (binary), '24GB' (decimal), '512MiB', '0' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size: write e.g. 24GiB, 512MiB or 80GB")
    return int(float(match.group(1)) * _UNITS[unit])


def size_flag(nbytes: int, up: bool = True) -> str:
    """`nbytes` as a size flag takes it (`parse_bytes` reads it back): whole GiB as such, bytes
    under 1 MiB, else whole MiB rounded `up` (a need: that much is enough) or down (a budget: no
    more than it was), with the GiB beside it from 1 GiB. '537MiB', '24GiB', '24034MiB (23.47
    GiB)'."""
    if nbytes % 2**30 == 0:
        return f"{nbytes // 2**30}GiB"
    if nbytes < 2**20:
        return f"{nbytes}B"
    mib = -(-nbytes // 2**20) if up else nbytes // 2**20
    return f"{mib}MiB" + (f" ({nbytes / 2**30:.2f} GiB)" if nbytes >= 2**30 else "")


def size_text(nbytes: int) -> str:
    """`nbytes` to read: GiB to 2 decimals from 1 GiB, MiB to 1 from 1 MiB ('14.0 MiB'), else
    KiB to 1."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


@dataclass(frozen=True)
class Plan:
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    slot_bytes: int
    base_blobs: int
    delta_blobs: int
    gpu_base_slots: int
    gpu_delta_slots: int
    host_blobs: int
    blobs_per_token: int  # base blobs one token reads (MoE layers × top-k)
    staging: int = 0  # of the GPU slots, those zero-copy decode stages guesses in (all layers)
    stage: int = 0  # their --zero-copy-stage (per MoE layer)
    host_embedding_bytes: int = 0  # --embeddings host: the table in host RAM
    ranks: int = 1  # expert parallel (--gpus N): this plan is each GPU's, its 1 / N of experts

    @property
    def gpu_expert_bytes(self) -> int:
        return (self.gpu_base_slots + self.gpu_delta_slots) * self.slot_bytes

    def traffic_per_token(self, gpu_hit_rate: float) -> tuple[float, float]:
        """(bytes over PCIe, bytes from disk) per token for base planes at this GPU hit rate."""
        missed = self.blobs_per_token * (1 - gpu_hit_rate) * self.slot_bytes
        off_gpu = max(1, self.base_blobs - self.gpu_base_slots)
        from_host = min(1.0, self.host_blobs / off_gpu)
        return missed, missed * (1 - from_host)

    def render(self, hit_rates: tuple[float, ...] = (0.5, 0.75, 0.9)) -> str:
        mib = 2**20
        lines = (
            [
                f"per GPU, each of {self.ranks} (expert parallel): dense layers and KV cache on "
                f"every GPU, each GPU's blob counts its share of the experts"
            ]
            if self.ranks > 1
            else []
        )
        lines += [
            f"GPU:  dense {self.dense_bytes / mib:,.0f} MiB + KV cache {self.kv_bytes / mib:,.0f} "
            f"MiB + workspace {self.workspace_bytes / mib:,.0f} MiB + expert slots "
            f"{self.gpu_expert_bytes / mib:,.0f} MiB ({self.gpu_base_slots} of {self.base_blobs} "
            f"base blobs, {self.gpu_delta_slots} of {self.delta_blobs} delta blobs; "
            f"{self.slot_bytes / mib:.2f} MiB each)",
            f"host: {self.host_blobs} further expert blobs "
            f"({self.host_blobs * self.slot_bytes / mib:,.0f} MiB)"
            + (
                f" + the embedding table {self.host_embedding_bytes / mib:,.0f} MiB"
                if self.host_embedding_bytes
                else ""
            ),
        ]
        if self.gpu_base_slots == self.base_blobs:
            lines.append("every base blob fits on the GPU: no expert traffic once they are loaded")
            return "\n".join(lines)
        lines.append("disk: the rest, read from the store's experts file")
        if self.staging:
            lines.append(
                f"zero-copy decode (--native on CUDA): {self.staging} of the expert slots stage "
                f"the next layer's guessed experts ({self.stage} per MoE layer, "
                "--zero-copy-stage)"
            )
        for h in hit_rates:
            pcie, disk = self.traffic_per_token(h)
            lines.append(
                f"per token at a {h:.0%} GPU hit rate: {pcie / mib:,.1f} MiB over PCIe, "
                f"{disk / mib:,.1f} MiB of it from disk"
            )
        return "\n".join(lines)


def plan(
    store: Store,
    gpu_memory: int,
    host_memory: int = 0,
    max_context: int = 4096,
    batch: int = 1,
    dtype_bytes: int = 2,
    workspace: int = WORKSPACE_BYTES,
    zero_copy_stage: int = 0,
    embeddings_host: bool = False,
    ranks: int = 1,
) -> Plan:
    """Split `gpu_memory` and `host_memory` (bytes) between the parts of `store`; ValueError
    when the dense part, KV cache and workspace alone do not fit on the GPU. With experts off
    the GPU and a host tier, `zero_copy_stage` staging slots per MoE layer are counted among
    the GPU slots (`zero_copy.staging_slots`). With `embeddings_host` the embedding table is
    counted in host RAM instead of on the GPU (`--embeddings host`). `ranks` > 1: expert
    parallel, the budgets are each GPU's (and its host share's), which holds the dense part,
    the whole KV cache and ceil(E / ranks) experts of each layer (`_per_rank`)."""
    slot = align_up(max(e.nbytes for e in store.blobs.values()), TENSOR_ALIGN)
    base = sum(1 for key in store.blobs if key[2] == "base")
    # quantized dense weights (and their scales) as stored, other floating tensors at the dtype
    by_class = store.dense_bytes_by_class(dtype_bytes)
    host_embedding = by_class.get("embed", 0) if embeddings_host else 0
    dense = sum(by_class.values()) - host_embedding
    sizes = _Sizes(
        dense, slot, base, len(store.blobs) - base, len(store.moe_layers), host_embedding
    )
    return _plan(store.model_config, _per_rank(sizes, store.model_config, ranks), gpu_memory,
                 host_memory, max_context, batch, dtype_bytes, workspace,
                 zero_copy_stage)  # fmt: skip


def plan_shape(
    hf_config: dict[str, Any],
    gpu_memory: int,
    host_memory: int = 0,
    experts: str | BlobFormat = "q2s",
    max_context: int = 4096,
    batch: int = 1,
    dtype_bytes: int = 2,
    workspace: int = WORKSPACE_BYTES,
    zero_copy_stage: int = 0,
    embeddings_host: bool = False,
    dense: DensePolicy | None = None,
    ranks: int = 1,
) -> Plan:
    """`plan` for the store `hf_config` (a config.json dict) would convert to with `experts`
    blobs (quant/synthetic.expert_format: "q2s" or "bfloat16", or a BlobFormat) and `dense`
    formats (`--dense`; None: every floating tensor at the run dtype), from the config alone:
    the dense parameters and MoE layers counted on the transformers model built on the meta
    device, quantized dense weights with their scales as `DenseFormat.tensors` stores them."""
    from moetier.quant.dense_formats import dense_class
    from moetier.quant.synthetic import expert_format

    tensors, moe_layers = _shape_tensors(hf_config)
    cfg = ModelConfig.from_hf(hf_config)
    fmt = experts if isinstance(experts, BlobFormat) else expert_format(hf_config, experts)
    slot = align_up(fmt.nbytes, TENSOR_ALIGN)
    nbytes = host_embedding = 0
    for name, (shape, dtype, floating) in tensors.items():
        size = _numel(shape) * (dtype_bytes if floating else torch_itemsize(dtype))
        chosen = None
        if dense is not None and floating and not name.endswith("norm.weight"):
            chosen = dense.choose(name, shape)  # as write_synthetic_store and convert choose
        if chosen is not None:
            size = sum(_numel(s) * torch_itemsize(d) for _, d, s in chosen.tensors(name, shape))
        if embeddings_host and floating and dense_class(name, len(shape)) == "embed":
            host_embedding += size
        else:
            nbytes += size
    sizes = _Sizes(nbytes, slot, moe_layers * cfg.num_experts, 0, moe_layers, host_embedding)
    return _plan(cfg, _per_rank(sizes, cfg, ranks), gpu_memory, host_memory, max_context,
                 batch, dtype_bytes, workspace, zero_copy_stage)  # fmt: skip


def _shape_tensors(
    hf_config: dict[str, Any],
) -> tuple[dict[str, tuple[tuple[int, ...], str, bool]], int]:
    """name -> (shape, dtype, floating) of the tensors a store of `hf_config` keeps dense, and
    its number of MoE layers; from the transformers model on the meta device, built once per
    config (`--dense auto` plans a model several times)."""
    key = json.dumps(hf_config, sort_keys=True, default=str)
    if key not in _SHAPE_CACHE:
        from moetier.quant.synthetic import dense_and_experts, meta_model

        dense, moe = dense_and_experts(meta_model(hf_config))
        _SHAPE_CACHE[key] = (
            {
                k: (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.is_floating_point())
                for k, t in dense.items()
            },
            len(moe),
        )
    return _SHAPE_CACHE[key]


_SHAPE_CACHE: dict[str, tuple[dict[str, tuple[tuple[int, ...], str, bool]], int]] = {}


def torch_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype named without its 'torch.' prefix."""
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


@dataclass(frozen=True)
class _Sizes:
    """What the split needs of a store: dense bytes on the GPU, the GPU slot of one blob, the
    number of base and delta blobs, and of MoE layers."""

    dense_bytes: int
    slot: int
    base: int
    delta: int
    moe_layers: int
    host_embedding: int = 0  # --embeddings host: the table's bytes in host RAM
    ranks: int = 1  # expert parallel: base and delta count one rank's share


def _per_rank(sizes: _Sizes, cfg: ModelConfig, ranks: int) -> _Sizes:
    """One rank's sizes under expert parallel over `ranks` GPUs: dense (replicated) as it is,
    the blobs of the busiest rank: ceil(E / ranks) experts of each layer
    (residency/partition.py caps every rank at that)."""
    if ranks < 1:
        raise ValueError(f"--gpus must be at least 1, got {ranks}")
    if ranks == 1:
        return sizes
    share = -(-cfg.num_experts // ranks)  # experts of a layer on the busiest rank
    per_layer = max(1, cfg.num_experts)
    base = sizes.base // per_layer * share
    delta = sizes.delta // per_layer * share
    return _Sizes(sizes.dense_bytes, sizes.slot, base, delta, sizes.moe_layers,
                  sizes.host_embedding, ranks)  # fmt: skip


def _plan(
    cfg: ModelConfig,
    sizes: _Sizes,
    gpu_memory: int,
    host_memory: int,
    max_context: int,
    batch: int,
    dtype_bytes: int,
    workspace: int,
    zero_copy_stage: int,
) -> Plan:
    dense = sizes.dense_bytes
    host_embedding = sizes.host_embedding
    if host_embedding and host_memory:  # a host tier: the table takes its share first
        if host_embedding > host_memory:
            raise ValueError(
                f"--embeddings host: the embedding table ({size_text(host_embedding)}) does "
                f"not fit --host-memory {size_flag(host_memory, up=False)}: raise it to "
                f"{size_flag(host_embedding)} or more"
            )
        host_memory -= host_embedding
    kv = cfg.num_layers * cfg.kv_width * max_context * batch * dtype_bytes
    fixed = dense + kv + workspace
    if fixed > gpu_memory:
        raise ValueError(
            f"the dense weights ({size_text(dense)}), a KV cache of {max_context} tokens × "
            f"{batch} ({size_text(kv)}) and {size_text(workspace)} of workspace need "
            f"{size_flag(fixed)}, more than --gpu-memory {size_flag(gpu_memory, up=False)}: "
            "raise --gpu-memory (`moetier plan` also takes a shorter --max-context)"
        )
    slot, base, delta, layers = sizes.slot, sizes.base, sizes.delta, sizes.moe_layers
    slots = (gpu_memory - fixed) // slot
    gpu_base = min(base, slots)
    gpu_delta = min(delta, slots - gpu_base)
    host = min(base + delta - gpu_base - gpu_delta, host_memory // slot)
    stage = staging_slots(zero_copy_stage, gpu_base + gpu_delta, layers)
    if gpu_base == base or host == 0:
        stage = 0  # every expert pinned, or no zero-copy decode
    per_token = -(-layers * cfg.top_k // sizes.ranks)  # a rank's share, at balanced load
    return Plan(dense, kv, workspace, slot, base, delta, gpu_base, gpu_delta, host, per_token,
                stage * layers, stage, sizes.host_embedding, sizes.ranks)  # fmt: skip
