"""Every transformers MoE family on the breadth path, against its own HF forward.

The families are those the installed transformers has (config.moe_families); docs/models.md
lists each with its status. A family listed as passing is built tiny and random by transformers
(save_pretrained, bf16), converted to a bf16 store and a q2s store, and run through moetier's
experts op: logits within 1e-4 of HF's fp32 forward (for q2s, HF with the store's dequantised
experts) and the same greedy tokens. A family listed as refused must be refused by the converter
with the reason the table gives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiny_models import build_breadth

from moetier.config import (
    EngineConfig,
    ExpertActivation,
    ModelConfig,
    family_refusal,
    moe_families,
)
from moetier.core.layout import blob_view, has_tensor
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.kernels.moe_ref import expert_matrix
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.quant.convert import convert
from moetier.quant.experts_probe import ExpertsMismatch, check_model_experts
from moetier.quant.sources import ConvertError
from moetier.quant.store import Store

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
NEW_TOKENS = 8
ROW = re.compile(r"^\| `(\w+)` \| (.+?) \| (passes|refused) \| (.*?) \|$")


def documented() -> dict[str, tuple[str, str]]:
    """docs/models.md's table: model_type -> (status, reason)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match is not None:
            rows[match.group(1)] = (match.group(3), match.group(4))
    return rows


DOCUMENTED = documented()


def installed(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def test_docs_table_lists_every_family():
    """Each family the installed transformers has is in the table (rows for families that an
    older transformers lacks, or whose experts it had not decorated yet, are skipped there)."""
    found = set(moe_families())
    assert found, "no transformers family carries @use_experts_implementation"
    assert sorted(found - set(DOCUMENTED)) == []


@pytest.mark.parametrize("model_type", sorted(DOCUMENTED))
def test_family_against_hf(model_type, tmp_path):
    if model_type not in moe_families():
        import transformers

        pytest.skip(
            f"{model_type} is not a family with @use_experts_implementation experts on "
            f"transformers {transformers.__version__}"
        )
    status, reason = DOCUMENTED[model_type]
    if status == "refused":
        # the reason's words before a dash are the refusal's own; the rest explains them
        assert reason.split(" — ")[0] in refusal(model_type, tmp_path)
        return
    assert family_refusal(model_type) is None
    src = build_breadth(model_type, tmp_path / "hf", dtype=torch.bfloat16)
    bf16 = convert(src, tmp_path / "bf16", progress=False)
    assert Store(bf16).source_dtype == "bfloat16"
    ids = torch.randint(1, 320, (2, 10), generator=torch.Generator().manual_seed(7))
    ref = hf_reference(src)
    check(model_type, "bf16", bf16, ref, ids)
    q2s = convert_quantized(src, tmp_path / "q2s", group=32, progress=False)
    load_store_experts(ref, Store(q2s))
    check(model_type, "q2s", q2s, ref, ids)


def refusal(model_type: str, tmp_path: Path) -> str:
    """The message moetier refuses `model_type` with: by name (config.family_refusal), by its
    experts compute (the probe, on a tiny meta model), or by the converter or the loader."""
    from tiny_models import breadth_config
    from transformers import AutoModelForCausalLM

    by_name = family_refusal(model_type)
    if by_name is not None:
        return by_name
    config = breadth_config(model_type)
    model_config = ModelConfig.from_hf(config.to_dict())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    try:
        check_model_experts(meta, model_config.activation, model_config.expert_has_bias)
    except ExpertsMismatch as err:
        return str(err)
    src = build_breadth(model_type, tmp_path / "hf", dtype=torch.bfloat16)
    try:
        store = convert(src, tmp_path / "store", progress=False)
    except ConvertError as err:
        assert not (tmp_path / "store").exists()
        return str(err)
    loaded = load_model(store, EngineConfig(native=False, device="cpu", dtype="float32"))
    params = SamplingParams(max_new_tokens=2, temperature=0)
    with pytest.raises(Exception) as failure:  # noqa: PT011 - whatever the family hits
        Generator(loaded).generate([1, 2, 3], params)
    return str(failure.value)


@pytest.mark.parametrize("model_type", sorted(DOCUMENTED))
def test_config_reads_the_experts_geometry(model_type):
    """ModelConfig.from_hf's expert count and size, under each family's own keys, are the
    shapes of the experts modules transformers builds from the same config (on meta)."""
    from tiny_models import breadth_config
    from transformers import AutoModelForCausalLM

    if model_type not in moe_families() or DOCUMENTED[model_type][0] == "refused":
        pytest.skip(f"{model_type}: not a family here, or refused")
    config = breadth_config(model_type)
    ours = ModelConfig.from_hf(config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = [m for m in model.modules() if hasattr(m, "is_concatenated")]
    assert experts
    for module in experts:
        gate_up = module.gate_up_proj
        if module.is_transposed:
            gate_up = gate_up.transpose(1, 2)
        assert tuple(gate_up.shape) == (
            ours.num_experts,
            2 * ours.expert_intermediate_size,
            ours.hidden_size,
        )
    shared = [
        m
        for name, m in model.named_modules()
        if name.endswith(("shared_expert", "shared_experts"))
        and isinstance(getattr(m, "gate_proj", None), torch.nn.Linear)
    ]
    for module in shared:  # the families' shared-expert MLPs (other names are not checked)
        assert module.gate_proj.weight.shape[0] == ours.shared_expert_intermediate_size


def test_config_aliases():
    """Families' own names for the expert geometry; a dense config is refused by name."""
    from transformers import AutoConfig

    ernie = ModelConfig.from_hf(
        AutoConfig.for_model(
            "ernie4_5_moe", moe_num_experts=12, moe_k=3, moe_intermediate_size=48
        ).to_dict()
    )
    assert (ernie.num_experts, ernie.top_k, ernie.expert_intermediate_size) == (12, 3, 48)
    hunyuan = AutoConfig.for_model("hunyuan_v1_moe", num_experts=16).to_dict()
    hunyuan["moe_topk"] = [2, 4]  # one per layer, as hunyuan checkpoints may give it
    assert ModelConfig.from_hf(hunyuan).top_k == 4
    with pytest.raises(ValueError, match="none of num_experts / num_local_experts"):
        ModelConfig.from_hf(AutoConfig.for_model("qwen2").to_dict())


def test_probe_tells_activations_apart():
    """The probe passes an experts class only under the activation it computes."""
    from tiny_models import breadth_config
    from transformers import AutoModelForCausalLM

    for model_type, right, wrong in (
        ("qwen3_moe", ExpertActivation("silu"), ExpertActivation("gpt_oss")),
        ("gpt_oss", ExpertActivation("gpt_oss", 1.702, 7.0), ExpertActivation("silu")),
        ("deepseek_v4", ExpertActivation("silu_clamped", limit=10.0), ExpertActivation("silu")),
    ):
        if not installed(model_type):
            continue
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(breadth_config(model_type))
        bias = model_type == "gpt_oss"
        assert check_model_experts(model, right, bias) > 0
        with pytest.raises(ExpertsMismatch, match="differs from moetier's op"):
            check_model_experts(model, wrong, bias)
        with pytest.raises(ExpertsMismatch, match="biases"):
            check_model_experts(model, right, not bias)


def test_converter_refuses_experts_the_op_cannot_compute(tmp_path):
    """nemotron_h's experts have no gate projection: convert says so and writes nothing."""
    src = build_breadth("nemotron_h", tmp_path / "hf")
    with pytest.raises(ConvertError, match="nemotron_h is refused: .*without a gate projection"):
        convert(src, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()


def hf_reference(checkpoint: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, experts_implementation="eager"
    )
    return model.eval()


def check(model_type: str, kind: str, store: Path, ref: torch.nn.Module, ids: torch.Tensor):
    loaded = load_model(store, EngineConfig(native=False, device="cpu", dtype="float32"))
    with torch.no_grad():
        ours, theirs = loaded.model(ids).logits, ref(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{model_type} {kind}: max |logit diff| {diff:.3e}")
    assert diff <= 1e-4
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    tokens = Generator(loaded).generate(ids[0].tolist(), params).token_ids
    assert tokens == hf_greedy(ref, ids[:1])
    assert loaded.runtime.pairs > 0  # the experts ran through moetier's op


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    out = model.generate(
        ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=0, pad_token_id=0
    )
    tokens = out[0, ids.shape[1] :].tolist()
    return tokens[: tokens.index(0)] if 0 in tokens else tokens  # moetier leaves out the eos


def load_store_experts(ref: torch.nn.Module, store: Store) -> None:
    """Put the store's (dequantised) experts into the HF model, in the module's own layout."""
    with torch.no_grad():
        for layer, path in store.moe_modules.items():
            module = ref.get_submodule(path)
            fmt = store.blob_format(layer)
            for expert in range(store.model_config.num_experts):
                blob = store.blob(layer, expert)
                for name in ("gate_up", "down"):
                    weight = expert_matrix(blob, fmt, name)
                    module_layout(module, name + "_proj")[expert] = own_layout(module, name, weight)
                for name in ("gate_up_bias", "down_bias"):
                    if has_tensor(fmt, name):
                        bias = blob_view(blob, fmt.tensor(name)).float()
                        target = module_layout(module, name.replace("_bias", "_proj_bias"))
                        target[expert] = own_layout(module, name, bias)


def module_layout(module: torch.nn.Module, name: str) -> torch.Tensor:
    return getattr(module, name).data


def own_layout(module: torch.nn.Module, name: str, canonical: torch.Tensor) -> torch.Tensor:
    """A canonical matrix [out, in] ([gate; up] rows) or bias -> the module's own layout
    (gate and up rows interleaved, matrices transposed), as the converter reads them back."""
    tensor = canonical
    if name.startswith("gate_up") and not getattr(module, "is_concatenated", True):
        half = tensor.shape[0] // 2
        tensor = torch.stack([tensor[:half], tensor[half:]], dim=1).flatten(0, 1)
    if getattr(module, "is_transposed", False) and tensor.dim() == 2:
        tensor = tensor.t()
    return tensor
