"""Whether a transformers experts module computes what moetier's experts op computes.

The breadth path keeps the family's own router, shared experts and everything else, and replaces
only the experts module's forward (`@use_experts_implementation`) with moetier's op: per (token,
k) pair `w · down(act(gate_up(x)))` over the store's canonical `[gate; up]` rows, biases and the
family activation of config.ACTIVATIONS. `check_experts` runs the module's own forward (the one
the decorator wrapped) on small random weights laid out as the module stores them and compares
it with that formula, so an experts class that computes anything else (another activation, a
clamp, per-expert scales, a post-expert norm, experts without a gate) is refused with the reason
instead of being computed wrong.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from moetier.config import ExpertActivation
from moetier.kernels.moe_ref import expert_activation_ref

PROBE_HIDDEN = 16
PROBE_INTERMEDIATE = 8
PROBE_TOKENS = 6
# fp32 on both sides, the same products in another order
PROBE_TOLERANCE = 1e-4
WEIGHTS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


class ExpertsMismatch(ValueError):
    """An experts module computes something moetier's experts op does not."""


def check_experts(
    module: torch.nn.Module, activation: ExpertActivation, has_bias: bool, where: str = ""
) -> None:
    """Raise ExpertsMismatch (saying why) unless `module`'s own forward equals moetier's op.
    `module` may live on the meta device: the probe uses its attributes, not its weights."""
    name = f"{where or type(module).__name__} ({type(module).__name__})"
    if not getattr(module, "has_gate", True):
        raise ExpertsMismatch(
            f"{name}: experts without a gate projection (down(act(up(x)))); moetier's experts "
            "op computes down(act(gate(x)) * up(x))"
        )
    if getattr(module, "has_post_expert_norm", False):
        raise ExpertsMismatch(f"{name}: a norm after each expert, which moetier's op lacks")
    if bool(getattr(module, "has_bias", False)) != has_bias:
        raise ExpertsMismatch(
            f"{name}: experts {'with' if module.has_bias else 'without'} biases, the family's "
            f"config says {'with' if has_bias else 'without'}"
        )
    own = [n for n, p in module.named_parameters(recurse=True) if n not in WEIGHTS]
    own += [n for n, _ in module.named_buffers(recurse=True)]
    if own:
        raise ExpertsMismatch(
            f"{name}: experts with tensors moetier does not store ({', '.join(own)}: "
            "per-expert scales or similar)"
        )
    forward = getattr(type(module).forward, "__wrapped__", None)
    if forward is None:
        raise ExpertsMismatch(f"{name}: not an @use_experts_implementation class")
    experts = _num_experts(module)
    generator = torch.Generator().manual_seed(0)
    canonical = _canonical_weights(experts, has_bias, generator)
    probe = _probe_module(module, canonical)
    # values up to ~12 reach every clamp of the supported activations (limits 7 and 10)
    hidden = torch.randn(PROBE_TOKENS, PROBE_HIDDEN, generator=generator) * 2
    top_k = min(2, experts)
    ids = torch.stack(
        [torch.randperm(experts, generator=generator)[:top_k] for _ in range(PROBE_TOKENS)]
    )
    weights = torch.rand(PROBE_TOKENS, top_k, generator=generator)
    try:
        with torch.no_grad():
            theirs = forward(probe, hidden, ids, weights)
    except Exception as err:  # noqa: BLE001 - any failure means we cannot vouch for it
        raise ExpertsMismatch(
            f"{name}: its forward could not be checked against moetier's op "
            f"({type(err).__name__}: {err})"
        ) from None
    ours = _reference(hidden, ids, weights, canonical, activation)
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        raise ExpertsMismatch(f"{name}: its forward returns {type(theirs).__name__}, not [T, H]")
    diff = (theirs.float() - ours).abs().max().item()
    if not diff <= PROBE_TOLERANCE * max(1.0, ours.abs().max().item()):
        raise ExpertsMismatch(
            f"{name}: its experts compute differs from moetier's op with the {activation.kind} "
            f"activation by {diff:.3g} on random weights (another activation, clamp or scale): "
            f"{_activation_hint(module)}"
        )


def _num_experts(module: torch.nn.Module) -> int:
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and count > 0:
        return count
    for pname in ("gate_up_proj", "down_proj"):
        param = module._parameters.get(pname)
        if param is not None:
            return int(param.shape[0])
    raise ExpertsMismatch(f"{type(module).__name__}: cannot tell its number of experts")


def _canonical_weights(
    experts: int, has_bias: bool, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """[gate; up] rows [E, 2I, H], down [E, H, I] (the store's layout) and biases."""
    h, i = PROBE_HIDDEN, PROBE_INTERMEDIATE
    out = {
        "gate_up": torch.randn(experts, 2 * i, h, generator=generator) * 2,
        "down": torch.randn(experts, h, i, generator=generator) * 0.5,
    }
    if has_bias:
        out["gate_up_bias"] = torch.randn(experts, 2 * i, generator=generator)
        out["down_bias"] = torch.randn(experts, h, generator=generator)
    return out


def _probe_module(module: torch.nn.Module, canonical: dict[str, torch.Tensor]) -> Any:
    """A shallow copy of `module` holding `canonical` in the module's own layout (transposed
    and/or gate/up interleaved, as the converter reads them back)."""
    probe = copy.copy(module)
    probe._parameters = {}
    probe._buffers = {}
    probe._modules = dict(module._modules)
    transposed = bool(getattr(module, "is_transposed", False))
    concatenated = bool(getattr(module, "is_concatenated", True))
    for name, tensor in canonical.items():
        if name.startswith("gate_up") and not concatenated:
            i = tensor.shape[1] // 2
            tensor = torch.stack([tensor[:, :i], tensor[:, i:]], dim=2).flatten(1, 2)
        if transposed and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)
        pname = name.replace("gate_up", "gate_up_proj").replace("down", "down_proj")
        probe._parameters[pname] = torch.nn.Parameter(tensor.contiguous(), requires_grad=False)
    return probe


def _reference(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    canonical: dict[str, torch.Tensor],
    activation: ExpertActivation,
) -> torch.Tensor:
    """What moetier's op computes (moe_ref's formula) over the canonical weights."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.linear(hidden[t], canonical["gate_up"][e], _bias(canonical, "gate_up_bias", e))
            gate, up = h.chunk(2, dim=-1)
            h = expert_activation_ref(gate, up, activation)
            y = F.linear(h, canonical["down"][e], _bias(canonical, "down_bias", e))
            out[t] += weights[t, j] * y
    return out


def _bias(canonical: dict[str, torch.Tensor], name: str, expert: int) -> torch.Tensor | None:
    return canonical[name][expert] if name in canonical else None


def _activation_hint(module: torch.nn.Module) -> str:
    act = getattr(module, "act_fn", None)
    if act is not None:
        return f"its act_fn is {type(act).__name__}"
    return "it has no act_fn (a gate function of its own)"


def check_model_experts(
    model: torch.nn.Module, activation: ExpertActivation, has_bias: bool
) -> int:
    """`check_experts` on the first experts module of each class in `model` (meta or not);
    returns how many experts modules the model has."""
    checked: set[type] = set()
    count = 0
    for name, module in model.named_modules():
        if not hasattr(module, "is_concatenated"):  # set by @use_experts_implementation
            continue
        count += 1
        if type(module) not in checked:
            check_experts(module, activation, has_bias, name)
            checked.add(type(module))
    return count
