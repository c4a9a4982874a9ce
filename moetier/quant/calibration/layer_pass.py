"""A checkpoint's transformers model run one decoder layer at a time, from the source weights.

The model class is built on the meta device (as quant/convert.py plans with it); only the
embedding (and whatever else lies outside the decoder layers, the output head excepted) and one
decoder layer at a time are materialised, read from the checkpoint's shards through
`TensorReader` (FP8 dequantised). Each call runs the model's own forward over one batch of
calibration tokens, so every family computes its own masks, rotary tables and per-layer inputs;
the layers before the one being run return the stored output of the layer before it (whatever
object that layer returns, e.g. GLM-5's (hidden, index top-k)), and the run stops after it.

The experts modules call `calibration_experts_forward` (registered with transformers as the
experts implementation "moetier_calibration"), which hands (hidden, ids, weights) to the hook
the caller sets: record them, or return the quantized experts' output computed elsewhere.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetier.quant.convert import LAYER_RE, ConversionPlan
from moetier.quant.sources import ConvertError, TensorReader

IMPLEMENTATION = "moetier_calibration"
ExpertsHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def calibration_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    hook: ExpertsHook | None = getattr(module, "moetier_calibration", None)
    if hook is None:
        raise RuntimeError(f"{type(module).__name__}: no calibration hook set for this layer")
    return hook(hidden_states, top_k_index, top_k_weights)


class _Stop(Exception):
    def __init__(self, output: Any) -> None:
        self.output = output


class _Wrapped(torch.nn.Module):
    """Stands in for a decoder layer; attributes the model's loop reads come from the layer."""

    def __init__(self, layer: torch.nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a submodule: its params stay its own
        object.__setattr__(self, "_run", forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)


class LayerPass:
    """Runs decoder layer L of the checkpoint's model on a batch, given layer L-1's output."""

    def __init__(
        self, src: Path, plan: ConversionPlan, device: torch.device, dtype: torch.dtype
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, calibration_experts_forward)
        self.plan, self.device, self.dtype = plan, device, dtype
        hf_config = AutoConfig.from_pretrained(src)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        model.set_experts_implementation(IMPLEMENTATION)
        model.eval()
        self.model = model
        self.container_path, self.layers = _decoder_layers(model, plan)
        self.originals = list(self.layers)
        self.read = TensorReader(plan.quantization)
        prefix = self.container_path + "."
        self.layer_keys: dict[int, list[str]] = defaultdict(list)
        outside = []
        for key in plan.dense:
            if key in plan.mtp_dense:
                continue
            if key.startswith(prefix):
                self.layer_keys[int(key[len(prefix) :].split(".", 1)[0])].append(key)
            else:
                outside.append(key)
        head = _untied_head(model)
        self._assign([k for k in outside if k not in head])
        self._init_buffers(lambda name: not name.startswith(prefix))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def experts_module(self, layer: int) -> torch.nn.Module | None:
        module = self.plan.experts.get(layer)
        return None if module is None else self.model.get_submodule(module.path)

    def materialise(self, layer: int) -> None:
        """Layer `layer`'s dense weights onto the device (its experts stay on meta)."""
        self._assign(self.layer_keys.get(layer, []))
        own = f"{self.container_path}.{layer}."
        self._init_buffers(lambda name: name.startswith(own))

    def release(self, layer: int) -> None:
        self.originals[layer].to("meta")

    def run(self, layer: int, input_ids: torch.Tensor, previous: Any) -> Any:
        """Layer `layer`'s output for `input_ids` [B, T], `previous` being layer - 1's output
        for them (None for layer 0)."""

        def replay(*args: Any, **kwargs: Any) -> Any:
            return previous

        def active(*args: Any, **kwargs: Any) -> Any:
            raise _Stop(self.originals[layer](*args, **kwargs))

        for i in range(layer):
            self.layers[i] = _Wrapped(self.originals[i], replay)
        self.layers[layer] = _Wrapped(self.originals[layer], active)
        try:
            with torch.inference_mode():
                self.model(input_ids=input_ids.to(self.device), use_cache=False)
        except _Stop as stop:
            return stop.output
        finally:
            for i in range(layer + 1):
                self.layers[i] = self.originals[i]
        raise RuntimeError(f"the model's forward did not reach decoder layer {layer}")

    def close(self) -> None:
        self.read.close()

    def _assign(self, keys: list[str]) -> None:
        aliases: dict[int, list[str]] = defaultdict(list)
        for name, param in self.model.named_parameters(remove_duplicate=False):
            aliases[id(param)].append(name)
        names_of = {name: names for names in aliases.values() for name in names}
        meta = self.model.state_dict(keep_vars=True)
        for key in keys:
            tensor = self.read(self.plan.dense[key])
            if tensor.is_floating_point():
                tensor = tensor.to(meta[key].dtype)
            tensor = tensor.to(self.device)
            if key in names_of:
                param = torch.nn.Parameter(tensor, requires_grad=False)
                for alias in names_of[key]:
                    _set(self.model, alias, param, is_param=True)
            else:
                _set(self.model, key, tensor, is_param=False)

    def _init_buffers(self, wanted: Callable[[str], bool]) -> None:
        """Non-persistent buffers (rotary tables ...) by transformers' own initialiser."""
        owners: dict[str, list[str]] = defaultdict(list)
        for name, _ in self.model.named_non_persistent_buffers():
            if wanted(name):
                owner, _, leaf = name.rpartition(".")
                owners[owner].append(leaf)
        for owner_name, leaves in owners.items():
            owner = self.model.get_submodule(owner_name) if owner_name else self.model
            if any(True for _ in owner.parameters()):
                raise ConvertError(f"cannot initialise buffers of {owner_name}: it owns weights")
            for leaf in leaves:
                owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device=self.device)  # type: ignore[arg-type]
            with torch.no_grad():
                self.model._init_weights(owner)


def _decoder_layers(
    model: torch.nn.Module, plan: ConversionPlan
) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList of decoder layers: the one the experts modules live in."""
    path = next(iter(plan.experts.values())).path
    match = LAYER_RE.search(path + ".")
    if match is None:
        raise ConvertError(f"cannot tell the decoder layers of {path}")
    container = path[: match.start()] + ("." if match.group(0).startswith(".") else "")
    container = (container + "layers").lstrip(".")
    layers = model.get_submodule(container)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != plan.model_config.num_layers:
        raise ConvertError(
            f"{plan.model_config.model_type}: calibration runs the decoder layers one at a time "
            f"and found no list of {plan.model_config.num_layers} layers at {container}"
        )
    return container, layers


def _untied_head(model: Any) -> set[str]:
    """Names of the output head's weight unless tied to the input embedding (not needed here)."""
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        return set()
    return {name for name, p in model.named_parameters() if p is head.weight}


def _set(model: torch.nn.Module, name: str, value: torch.Tensor, *, is_param: bool) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if is_param:
        owner._parameters[leaf] = value  # type: ignore[assignment]
    else:
        owner._buffers[leaf] = value
