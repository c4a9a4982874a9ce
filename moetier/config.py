"""Frozen configuration dataclasses: the one place that reads raw HF config dicts.

`ModelConfig.from_hf` normalises a Hugging Face `config.json` into the few facts moetier's own
code needs; model code never reads raw HF config dicts. `EngineConfig` holds the runtime knobs
(device, dtype, expert cache budget); CLI flags are derived from its fields.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The model `moetier generate` and `moetier serve` run when given none: a 10M-parameter Qwen3-MoE
# trained on public-domain books (its model card is README.md in that folder).
DEFAULT_STORE = Path(__file__).parent / "assets" / "demo-moe-10m"

# Config keys under which the families name their expert geometry, first found wins. Expert size
# falls back to `intermediate_size` (Mixtral-style families size their experts by it).
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = (
    "num_experts_per_tok",
    "experts_per_token",
    "num_experts_per_token",
    "moe_k",
    "moe_topk",  # hunyuan: an int, or one per layer
    "top_k_experts",
)
EXPERT_SIZE_KEYS = ("moe_intermediate_size", "expert_intermediate_size")
SHARED_SIZE_KEYS = (
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_intermediate_size",
    "shared_experts_intermediate_size",
)
NUM_SHARED_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# Families whose experts' gated activation is not silu(gate) * up, with the config keys of its
# parameters (the converter checks each experts class against moetier's op numerically, so a
# family missing here is refused, not computed wrong: quant/experts_probe.py).
CLAMPED_ACTIVATIONS = {
    "gpt_oss": "gpt_oss",
    "deepseek_v4": "silu_clamped",
    "hy_v4": "silu_clamped",
    "minimax_m3_vl": "gpt_oss",
    "minimax_m3_vl_text": "gpt_oss",
}

# The activation applied between the gate/up and the down projection of a routed expert.
#   silu:          silu(gate) * up
#   silu_clamped:  silu(min(gate, limit)) * clamp(up, -limit, limit)           (DeepSeek-V4)
#   gpt_oss:       g = min(gate, limit); (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
ACTIVATIONS = ("silu", "silu_clamped", "gpt_oss")


def read_json(path: str | Path, fix: str = "replace it with a good copy") -> Any:
    """The JSON value in `path`; ValueError naming the file, and saying `fix` (what to do),
    where it is not UTF-8 JSON (truncated, damaged, another kind of file)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"{path} cannot be read as JSON ({err}): {fix}") from None


@dataclass(frozen=True)
class ExpertActivation:
    """How a routed expert combines its gate and up projections (see ACTIVATIONS)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class ModelConfig:
    """What moetier needs to know about a model, normalised from its HF config."""

    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    expert_has_bias: bool
    activation: ExpertActivation
    eos_token_ids: tuple[int, ...]
    # KV cache elements per token per layer as transformers' caches hold them (MLA families keep
    # full per-head keys and values there, not the compressed latent)
    kv_width: int = 0
    # summed size of the shared experts' MLP (0: none)
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Normalise a HF `config.json` dict; raises ValueError for non-MoE or unknown families.

        A family is known when the installed transformers has a causal-LM class for it whose
        experts class carries `@use_experts_implementation` (`moe_families`)."""
        model_type = hf.get("model_type")
        text = hf.get("text_config")
        if isinstance(text, dict) and not _first(hf, *NUM_EXPERTS_KEYS):
            # a composite config (Qwen3.5, Gemma 4): the geometry is the text model's; the family
            # is the top level's (its causal-LM class is what transformers builds)
            hf = {**text, "model_type": model_type or text.get("model_type")}
            model_type = hf["model_type"]
        num_experts = _first(hf, *NUM_EXPERTS_KEYS)
        if not num_experts:
            raise ValueError(
                f"model_type {model_type!r} has no routed experts (none of "
                f"{' / '.join(NUM_EXPERTS_KEYS)} in config.json): moetier runs Mixture-of-"
                "Experts models only; use a dense-model runtime (transformers, llama.cpp) for it."
            )
        refusal = family_refusal(str(model_type))
        if refusal is not None:
            raise ValueError(refusal)
        kind = CLAMPED_ACTIVATIONS.get(str(model_type), "silu")
        default_limit = 7.0 if kind == "gpt_oss" else 10.0
        activation = ExpertActivation(
            kind,
            alpha=float(_first(hf, "swiglu_alpha") or 1.702),
            limit=float(_first(hf, "swiglu_limit") or default_limit),
        )
        intermediate = _first(hf, *EXPERT_SIZE_KEYS) or hf.get("intermediate_size")
        if not intermediate:
            raise ValueError(
                f"model_type {model_type!r}: no expert size in config.json (none of "
                f"{' / '.join((*EXPERT_SIZE_KEYS, 'intermediate_size'))})"
            )
        top_k = _first(hf, *TOP_K_KEYS)
        if isinstance(top_k, list):  # one per layer (hunyuan's moe_topk): the largest
            top_k = max(top_k)
        if not top_k:
            raise ValueError(
                f"model_type {model_type!r}: no experts per token in config.json (none of "
                f"{' / '.join(TOP_K_KEYS)})"
            )
        shared = _first(hf, *SHARED_SIZE_KEYS)
        if shared is None:
            shared = int(_first(hf, *NUM_SHARED_KEYS) or 0) * int(intermediate)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=str(model_type),
            hidden_size=int(hf["hidden_size"]),
            num_layers=_num_layers(hf),
            vocab_size=int(hf["vocab_size"]),
            num_experts=int(num_experts),
            top_k=int(top_k),
            expert_intermediate_size=int(intermediate),
            expert_has_bias=model_type == "gpt_oss",
            activation=activation,
            eos_token_ids=eos_ids,
            kv_width=_kv_width(hf),
            shared_expert_intermediate_size=int(shared),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{config_path} not found: point at a Hugging Face model directory")
        return cls.from_hf(read_json(config_path, "download the checkpoint's config.json again"))


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder facts a native model file needs (attention, norms, MLP/MoE layout), read from
    a transformers config object (whose own class has filled in the defaults)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]  # decoder layers whose MLP is a sparse MoE block
    rope_type: str
    # DeepSeek-V3-style routing (sigmoid scores, group-limited top-k, scaled weights) and shared
    # experts; the defaults leave softmax-routed families as they are
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # multi-head latent attention (MLA); kv_lora_rank 0 = not MLA, q_lora_rank 0 = plain q_proj
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    mla_softmax_scale: float = 0.0  # qk_head_dim ** -0.5 times yarn's mscale(mscale_all_dim) ** 2

    @classmethod
    def from_transformers(cls, hf: Any) -> DecoderConfig:
        """hf: a transformers `PretrainedConfig`. Raises ValueError for what native models lack."""
        if getattr(hf, "sliding_window", None) is not None:
            raise ValueError(
                "sliding-window attention is not in the native model files yet: "
                "run this model without --native"
            )
        rope_type = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            raise ValueError(
                f"rope_type {rope_type!r} changes with the sequence length, which a static "
                "decode step cannot follow: run this model without --native"
            )
        layers = int(hf.num_hidden_layers)
        sparse_step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        mlp_only = set(getattr(hf, "mlp_only_layers", None) or ())
        first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)  # DeepSeek: dense first
        num_experts = int(getattr(hf, "num_experts", None) or hf.num_local_experts)
        moe_layers = tuple(
            i
            for i in range(layers)
            if i not in mlp_only
            and i >= first_dense
            and num_experts > 0
            and (i + 1) % sparse_step == 0
        )
        heads = int(hf.num_attention_heads)
        mla: dict[str, Any] = {}
        if getattr(hf, "kv_lora_rank", None):
            nope, rope = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
            mla = dict(
                q_lora_rank=int(getattr(hf, "q_lora_rank", None) or 0),
                kv_lora_rank=int(hf.kv_lora_rank),
                qk_nope_head_dim=nope,
                qk_rope_head_dim=rope,
                v_head_dim=int(hf.v_head_dim),
                rope_interleave=bool(getattr(hf, "rope_interleave", False)),
                mla_softmax_scale=_mla_softmax_scale(hf.rope_parameters or {}, nope + rope),
            )
        return cls(
            model_type=hf.model_type,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.num_key_value_heads),
            head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
            rms_norm_eps=float(hf.rms_norm_eps),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            intermediate_size=int(hf.intermediate_size),
            # families without dense MLPs (MiniMax-M2, Mixtral) size their experts by
            # intermediate_size
            moe_intermediate_size=int(
                getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
            ),
            num_experts=num_experts,
            top_k=int(hf.num_experts_per_tok),
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
            moe_layers=moe_layers,
            rope_type=rope_type,
            n_group=int(getattr(hf, "n_group", None) or 1),
            topk_group=int(getattr(hf, "topk_group", None) or 1),
            routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", None) or 1.0),
            n_shared_experts=int(getattr(hf, "n_shared_experts", None) or 0),
            **mla,
        )


def experts_classes(model_type: str) -> tuple[type, ...]:
    """The classes of `model_type`'s transformers modeling module that carry
    `@use_experts_implementation` (empty when it has none, or this transformers lacks the
    family). Found by what the decorator leaves: a `forward` defined in transformers'
    integrations.moe wrapping the class's own (`__wrapped__`), as on transformers 5.17 to 5.24."""
    import importlib

    module_name = _modeling_module(model_type)
    if module_name is None:
        return ()
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return ()
    return tuple(
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__ == module.__name__ and _is_dispatched(obj)
    )


def _is_dispatched(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    return (
        hasattr(forward, "__wrapped__")
        and getattr(forward, "__globals__", {}).get("__name__") == "transformers.integrations.moe"
    )


def _modeling_module(model_type: str) -> str | None:
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    name = model_type_to_module_name(model_type)
    return f"transformers.models.{name}.modeling_{name}"


@functools.cache
def moe_families() -> tuple[str, ...]:
    """Every model_type of the installed transformers that moetier's breadth path can build: a
    causal-LM class whose modeling module has an experts class carrying
    `@use_experts_implementation` (some of them are refused, `family_refusal` says why)."""
    import importlib.util

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        module_name = _modeling_module(model_type)
        spec = importlib.util.find_spec(module_name) if module_name else None
        if spec is None or spec.origin is None:
            continue
        # a cheap look at the source first: importing every modeling module takes long
        if "use_experts_implementation" not in Path(spec.origin).read_text(encoding="utf-8"):
            continue
        if experts_classes(model_type):
            found.append(model_type)
    return tuple(found)


# Families the breadth path accepts in transformers' terms but computes wrong or cannot build;
# each with the reason (docs/models.md lists them). The converter and the loader also check
# every experts class against moetier's op numerically (quant/experts_probe.py).
REFUSED_FAMILIES: dict[str, str] = {
    "minimax": "it needs its own cache class (MiniMaxCache); moetier's engine runs "
    "transformers models with a DynamicCache",
}


def family_refusal(model_type: str) -> str | None:
    """Why moetier refuses `model_type` (None: accepted)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in REFUSED_FAMILIES:
        return f"model_type {model_type!r} is refused: {REFUSED_FAMILIES[model_type]}"
    if not experts_classes(model_type):
        if _modeling_module(model_type) is None:
            return (
                f"model_type {model_type!r} is not known to the installed transformers "
                f"{transformers.__version__}: upgrade transformers within moetier's range "
                "(pyproject.toml) or open an issue with the model's config.json"
            )
        return (
            f"model_type {model_type!r} is not supported: its transformers experts module does "
            "not carry @use_experts_implementation, so moetier's experts op cannot replace it "
            f"(transformers {transformers.__version__}). Open an issue with the model's "
            "config.json."
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"model_type {model_type!r} has no causal-LM class in transformers (a multimodal or "
            "non-generative model): moetier runs causal text models; convert its text model if "
            "it has one of its own model_type"
        )
    return None


def _mla_softmax_scale(rope_parameters: dict[str, Any], qk_head_dim: int) -> float:
    """transformers' DeepSeek-V3 attention scale (yarn_apply_mscale): qk_head_dim ** -0.5, times
    mscale(factor, mscale_all_dim) ** 2 when the rope is scaled and mscale_all_dim is set."""
    scale = qk_head_dim**-0.5
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        factor = rope_parameters["factor"]
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale


def _kv_width(hf: dict[str, Any]) -> int:
    """Values cached per token and layer: keys and values of each KV head, or for MLA the
    compressed latent and the shared rope key (what transformers >= 5 and the native
    deepseek_v3 file cache; full per-head keys and values would be ~70x more)."""
    heads = int(hf.get("num_attention_heads") or 1)
    if hf.get("kv_lora_rank"):
        return int(hf["kv_lora_rank"]) + int(hf.get("qk_rope_head_dim") or 0)
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    return 2 * int(hf.get("num_key_value_heads") or heads) * head_dim


def _num_layers(hf: dict[str, Any]) -> int:
    """num_hidden_layers, or the length of the per-layer pattern of families that derive it
    (nemotron_h's layers_block_type)."""
    if hf.get("num_hidden_layers") is not None:
        return int(hf["num_hidden_layers"])
    for key in ("layers_block_type", "layer_types"):
        if isinstance(hf.get(key), list):
            return len(hf[key])
    raise ValueError("config.json names no num_hidden_layers")


def _first(d: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    return None


GATE_TERMS = (
    "weight",
    "entropy",
    "margin",
    "confidence",
    "sensitivity",
    "hot",
    "random",
    "forced",
    "act",
)
TABLE_TERMS = ("sensitivity", "hot")  # terms read from a per-(layer, expert) table file
FILE_TERMS = (*TABLE_TERMS, "act")  # terms that take @FILE (act: the sketch file)


@dataclass(frozen=True)
class DeltaRule:
    """`--delta`'s grammar (the confidence gate, moetier/gate; docs/gate.md):

        none | all | [resident:] (SCORE:T | budget:F:SCORE)
        SCORE := PRODUCT (+ PRODUCT)*     PRODUCT := TERM (* TERM)*     TERM := NAME[@FILE]

    SCORE:T applies the delta to pairs whose score is >= T; budget:F:SCORE to the best
    F * pairs pairs of each experts call, a fraction of a pair carried on to the next layer
    (gate/policies.budget_count; ties broken by position). `resident:` keeps
    only pairs whose delta is on the GPU. `weight:T` is the old routing-weight rule. `act` (the
    pair's base hidden activation through a sketch of its down delta) is known only inside the
    experts op, so it takes the threshold form only and at most once per product."""

    score: tuple[tuple[str, ...], ...] = ()  # sum of products of terms ("name" or "name@file")
    threshold: float | None = None
    budget: float | None = None
    resident: bool = False
    everywhere: bool = False  # `all`

    @staticmethod
    def parse(text: str) -> DeltaRule | None:
        text = text.strip()
        if text == "none":
            return None
        if text == "all":
            return DeltaRule(everywhere=True)
        usage = (
            f"--delta {text!r}: use all, none or weight:T (e.g. weight:0.3), or a gate rule "
            "SCORE:T or budget:F:SCORE with an optional resident: prefix, SCORE summing (+) "
            f"products (*) of {', '.join(GATE_TERMS)} (sensitivity, hot and act take @FILE), "
            "e.g. budget:0.25:weight*sensitivity or weight*weight*act:0.5 (docs/gate.md)"
        )
        resident = text.startswith("resident:")
        if resident:
            text = text.removeprefix("resident:")
        threshold = budget = None
        try:
            if text.startswith("budget:"):
                fraction, _, score_text = text.removeprefix("budget:").partition(":")
                budget = float(fraction)
                if not 0.0 <= budget <= 1.0:
                    raise ValueError
            else:
                score_text, _, value = text.rpartition(":")
                threshold = float(value)
                if not math.isfinite(threshold):
                    raise ValueError
        except ValueError:
            raise ValueError(usage) from None
        score = tuple(
            tuple(term.strip() for term in product.split("*")) for product in score_text.split("+")
        )
        for product in score:
            for term in product:
                name, at, path = term.partition("@")
                if name not in GATE_TERMS or (at and (name not in FILE_TERMS or not path)):
                    raise ValueError(f"{usage}; {term!r} is not a term")
            if sum(term.partition("@")[0] == "act" for term in product) > 1:
                raise ValueError(f"--delta {text!r}: act may appear once per product")
        acts = {term for product in score for term in product if term.partition("@")[0] == "act"}
        if acts and budget is not None:
            raise ValueError(
                f"--delta {text!r}: the act term is scored per pair inside the experts op, "
                "after its base gate_up, so it takes the threshold form SCORE:T only (a budget "
                "needs the whole call's scores first), e.g. weight*weight*act:0.5"
            )
        if len(acts) > 1:
            raise ValueError(f"--delta {text!r}: act terms must all read one sketch file")
        return DeltaRule(score, threshold, budget, resident)

    def terms(self) -> set[str]:
        """The term names the score uses (without @FILE)."""
        return {term.partition("@")[0] for product in self.score for term in product}


# The dtypes a model computes in (--dtype): those the experts kernels' dots and the model files
# run. The storage table (core/layout.DTYPES) holds the integer and fp8 types of stored tensors.
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


# EngineConfig fields that only the native model files read (--mtp and --mtp-file: the
# speculative drafter; --zero-copy-stage: the native decode's staging; --expert-hotness: the
# expert-parallel split); cuda_graph, compile_decode, compile_prefill and lookahead are left out,
# since turning them off where there is nothing to turn off is harmless
NATIVE_ONLY_FIELDS = ("mtp", "mtp_file", "zero_copy_stage", "expert_hotness")


@dataclass(frozen=True)
class EngineConfig:
    """Runtime settings. Each field becomes a CLI flag (`--expert-cache-mb` ...)."""

    device: str = field(
        default="auto", metadata={"help": "cuda, cuda:N, cpu, or auto (cuda when available)"}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "compute dtype: float32, bfloat16, float16, or auto "
            "(the checkpoint's dtype on CUDA, float32 on CPU)"
        },
    )
    expert_cache_mb: float = field(
        default=0.0,
        metadata={
            "help": "memory budget of the expert slot cache in MiB (0 = room for every expert)"
        },
    )
    gpu_memory: str = field(
        default="",
        metadata={
            "help": "GPU memory budget (e.g. 24GiB): dense weights, a 4096-token KV cache and "
            "workspace first, the rest sizes the expert cache (overrides --expert-cache-mb); "
            "`moetier plan` shows the split"
        },
    )
    host_memory: str = field(
        default="",
        metadata={
            "help": "host RAM budget for expert blobs (e.g. 64GiB; pinned when CUDA is "
            "available): cache misses it holds are copied from there instead of the store's "
            "file; empty = no host tier"
        },
    )
    embeddings: str = field(
        default="gpu",
        metadata={
            "help": "where the input embedding table lives: gpu, or host (pinned host RAM; "
            "each step's rows are read over PCIe, a few KB a token; the planner counts it off "
            "the GPU budget and on the host budget)"
        },
    )
    expert_cache_slots: int = field(
        default=0, metadata={"help": "cap the expert cache at this many experts (0 = no cap)"}
    )
    zero_copy_stage: int = field(
        default=3,
        metadata={
            "help": "with --native on CUDA, when experts are read from pinned host RAM "
            "(zero-copy decode): GPU slots per MoE layer that take the next layer's best-guessed "
            "experts, copied in while the layer before computes (at most a quarter of the expert "
            "cache; 0 = off; Qwen3-MoE-style routers)"
        },
    )
    expert_reads: str = field(
        default="mmap",
        metadata={
            "help": "how cache misses read the store: mmap (through the page cache) or direct "
            "(parallel O_DIRECT preads, no double caching; buffered where the filesystem "
            "refuses O_DIRECT)"
        },
    )
    cache_policy: str = field(
        default="lru",
        metadata={
            "help": "which expert the cache evicts: lru, lfu (decayed frequency), or wlfu "
            "(decayed routing-weight sum); docs/residency.md compares them"
        },
    )
    verify: bool = field(
        default=True,
        metadata={
            "help": "check each expert blob's crc32 the first time it is read into a tier (host "
            "RAM or the GPU cache), and dense.safetensors' at load (stores converted since the "
            "index records it); a corrupted blob is an error naming its layer, expert, plane "
            "and file offset; --no-verify skips the checks (`moetier verify STORE` checks all)"
        },
    )
    native: bool = field(
        default=True,
        metadata={
            "help": "run the native model file (paged KV cache, compiled CUDA-graph decode) where "
            "the model type has one (the families marked native in docs/models.md); --no-native "
            "runs the transformers model class (every family, slower)"
        },
    )
    cuda_graph: bool = field(
        default=True,
        metadata={
            "help": "with --native on CUDA: pin every expert on the GPU when they all fit the "
            "expert cache and replay each decode step from a CUDA graph (one per context-length "
            "bucket); --no-cuda-graph decodes eagerly"
        },
    )
    compile_decode: bool = field(
        default=True,
        metadata={
            "help": "with the CUDA graph: compile the decode step with torch.compile first "
            "(faster steps; the serving engine compiles at load, kept in "
            "~/.cache/moetier/inductor; --no-compile-decode skips it)"
        },
    )
    compile_prefill: bool = field(
        default=False,
        metadata={
            "help": "with the CUDA graph and every expert on the GPU: compile the prefill steps "
            "(prompt chunks, a conversation's new turn) with torch.compile at load, one graph "
            "for every length (GQA families; an H100 agent turn's first token 22-24 ms against "
            "29-32 eager, docs/benchmarks.md; off by default: a new prompt shape can still "
            "compile a kernel specialisation for 1-2 s the first time)"
        },
    )
    lookahead: bool = field(
        default=True,
        metadata={
            "help": "with the CUDA graph: launch the next decode step of the running requests "
            "before the host has handled this step's tokens (the GPU never waits for the "
            "scheduler and detokenizer); --no-lookahead runs one step at a time"
        },
    )
    delta: str = field(
        default="all",
        metadata={
            "help": "where a store's delta plane is applied (the confidence gate, docs/gate.md): "
            "all, none, SCORE:T (pairs whose score is >= T, e.g. weight:0.34) or "
            "budget:F:SCORE (the best fraction F of each layer call's pairs); SCORE is a sum "
            "(+) of products (*) of weight, entropy, margin, confidence, sensitivity[@FILE], "
            "hot[@FILE], random, forced, act[@FILE] (the pair's base hidden activation through "
            "the down delta's sketch, `moetier quality STORE --write-act-sketch 16`; threshold "
            "form only); a resident: prefix keeps only deltas on the GPU"
        },
    )

    mtp: bool = field(
        default=False,
        metadata={
            "help": "load the MTP layer the store keeps (a checkpoint that ships one: "
            "DeepSeek-V3, GLM-4.x, GLM-5), for speculative decoding; on with "
            "--speculative-tokens"
        },
    )
    mtp_file: str = field(
        default="",
        metadata={
            "help": "an MTP layer for a model without one (a safetensors file of "
            "model.layers.{num_hidden_layers}.* tensors, e.g. scripts/train_mtp.py's): loaded "
            "beside the model for speculative decoding (--speculative-tokens)"
        },
    )
    delta_memory: str = field(
        default="",
        metadata={
            "help": "the delta cache: this much of the expert cache (e.g. 4GiB) holds delta "
            "planes only, those the gate applied most, kept apart from the base planes, which "
            "the rest holds by use; where the experts do not all fit the GPU and are read "
            "zero-copy from --host-memory (a delta off the GPU is read from host RAM). Empty: "
            "base and delta planes share the cache, a delta ranked as its expert"
        },
    )

    cpu_experts: str = field(
        default="off",
        metadata={
            "help": "hybrid misses (needs --host-memory): auto lets the host's cores compute the "
            "GPU-cache misses a cost model of measured PCIe, DRAM-kernel and sync speeds gives "
            "them, from the host tier, while the others are fetched; off fetches every miss; "
            "share:F forces a share F of each layer's misses onto the CPU (tests). Eager steps "
            "only (not the zero-copy CUDA-graph step)"
        },
    )
    cpu_threads: int = field(
        default=0,
        metadata={
            "help": "threads of the CPU expert kernel (0 = every core, less one on CUDA for the "
            "thread that drives the GPU)"
        },
    )

    gpus: int = field(
        default=0,
        metadata={
            "help": "expert parallel over this many processes, one GPU each (torch.distributed: "
            "NCCL on CUDA, gloo on CPU with --device cpu): every MoE layer's experts split "
            "between them, each with its own expert cache, dense layers on every one; or run "
            "under torchrun, which sets WORLD_SIZE (docs/multi-gpu.md). Budgets are per GPU. "
            "0: one process, or torchrun's ranks when torchrun started this one; 1: one "
            "process whatever the environment says"
        },
    )
    expert_hotness: str = field(
        default="",
        metadata={
            "help": "with --gpus N: how often each expert is used, to split experts between the "
            "GPUs at equal expected load: a routing trace .npz (expert_ids [MoE layers, tokens, "
            'k]) or a table {"layers": {"<layer>": [E counts]}}; empty: round-robin'
        },
    )

    def cpu_share(self) -> float | None:
        """--cpu-experts: None = off, -1 = auto (the cost model), F = a forced share."""
        if self.cpu_experts == "off":
            return None
        if self.cpu_experts == "auto":
            return -1.0
        kind, _, value = self.cpu_experts.partition(":")
        try:
            if kind == "share" and 0.0 <= float(value) <= 1.0:
                return float(value)
        except ValueError:
            pass
        raise ValueError(f"--cpu-experts {self.cpu_experts!r}: use auto, off or share:F (0..1)")

    def delta_threshold(self) -> float | None:
        """None = no delta; 0 = every pair; T = pairs with routing weight >= T; NaN = another
        gate rule (`delta_rule`), which decides the pairs."""
        rule = self.delta_rule()
        if rule is None:
            return None
        if rule.everywhere:
            return 0.0
        if rule.score == (("weight",),) and rule.threshold is not None and not rule.resident:
            return rule.threshold
        return math.nan

    def delta_rule(self) -> DeltaRule | None:
        """--delta parsed (None: none); raises ValueError naming the mistake."""
        return DeltaRule.parse(self.delta)

    def resolved_device(self) -> str:
        """--device: auto is cuda where torch finds a CUDA GPU, else cpu. ValueError, one line
        saying what to give, for a device moetier does not run on or this machine lacks."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        try:
            kind = torch.device(self.device).type
            index = torch.device(self.device).index
        except (RuntimeError, ValueError):  # not a device name torch knows ("tpu")
            kind, index = "", None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: use cuda, cuda:N, cpu or auto")
        if kind == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                why = "is built without CUDA" if torch.version.cuda is None else "finds no GPU"
                raise ValueError(
                    f"--device {self.device}: this machine's torch {why}: use --device cpu "
                    "(or auto, which takes a CUDA GPU where there is one)"
                )
            if index is not None and index >= count:
                raise ValueError(
                    f"--device {self.device}: this machine has {count} CUDA GPU(s), cuda:0 to "
                    f"cuda:{count - 1}"
                )
        return self.device

    def resolved_dtype(self, checkpoint_dtype: str) -> str:
        """--dtype: auto is the checkpoint's dtype on CUDA, float32 on CPU. ValueError for a
        dtype the model cannot compute in (COMPUTE_DTYPES)."""
        if self.dtype == "auto":
            return checkpoint_dtype if self.resolved_device().startswith("cuda") else "float32"
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"--dtype {self.dtype!r}: choose one of {', '.join(COMPUTE_DTYPES)} or auto "
                "(the dtype the model computes in)"
            )
        return self.dtype

    def native_only_flags(self) -> list[str]:
        """The flags set away from their defaults that only native model files read (the
        transformers model class ignores them: a run without one must refuse them, not drop
        them unsaid)."""
        return [
            "--" + f.name.replace("_", "-")
            for f in dataclasses.fields(self)
            if f.name in NATIVE_ONLY_FIELDS and getattr(self, f.name) != f.default
        ]

    def check_device_and_dtype(self) -> None:
        """ValueError for a --device this machine lacks or a --dtype the model cannot compute in,
        before anything is loaded."""
        self.resolved_device()
        self.resolved_dtype(COMPUTE_DTYPES[0])


def replace(config: Any, **changes: Any) -> Any:
    """dataclasses.replace, re-exported so callers need not import dataclasses."""
    return dataclasses.replace(config, **changes)
