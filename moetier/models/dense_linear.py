"""`DenseLinear`: a linear layer whose weight is stored quantized (quant/dense_formats.py), and
`quantize_linears`, which puts one in place of each nn.Linear a store quantizes.

Both model paths (a native model file, the transformers class) build their model on the meta
device, then call `quantize_linears(model, store.dense_formats)` before assigning the store's
tensors by name: the module's parameters carry the store's names (`weight` holds the codes,
`weight_scale_inv` or `weight_scale` / `weight_scale_2` the scales), dtypes and shapes, so
assignment by name fills them unchanged (`stored_dtype_names`: not cast to the compute dtype).
forward is `torch.ops.moetier.dense_linear` (kernels/dense_gemv.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from moetier.core.layout import DTYPES
from moetier.kernels.dense_gemv import dense_dequant_ref, dense_linear
from moetier.quant.dense_formats import DenseFormat

SCALE_NAMES = ("weight_scale_inv", "weight_scale", "weight_scale_2")


class DenseLinear(nn.Module):
    """y = x W^T + b with W in a quantized dense format; in_features / out_features as
    nn.Linear's."""

    # registered by __init__ as the format has them (fp8: weight_scale_inv; int4: weight_scale;
    # nvfp4: weight_scale and weight_scale_2)
    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, fmt: DenseFormat, bias: bool = False
    ) -> None:
        super().__init__()
        if not fmt.quantized:
            raise ValueError("DenseLinear holds a quantized format; bf16 stays nn.Linear")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.kind, self.block_n, self.block_k = fmt.kernel_args()
        for name, dtype, shape in fmt.tensors("weight", (out_features, in_features)):
            param = nn.Parameter(torch.empty(shape, dtype=DTYPES[dtype]), requires_grad=False)
            self.register_parameter(name, param)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )

    @property
    def scale(self) -> torch.Tensor:
        return self.weight_scale_inv if self.kind == "fp8" else self.weight_scale

    @property
    def scale_2(self) -> torch.Tensor | None:
        return self.weight_scale_2 if self.kind == "nvfp4" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(
            x, self.weight, self.scale, self.scale_2, self.bias, self.kind, self.block_n,
            self.block_k,
        )  # fmt: skip

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [N, K] decoded (float32, or `dtype`): for code that needs the matrix
        itself (MLA's absorbed kv_b_proj)."""
        w = dense_dequant_ref(
            self.weight, self.scale, self.scale_2, self.kind, self.block_n, self.block_k
        )
        return w if dtype is None else w.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt.name}"


def quantize_linears(model: nn.Module, formats: dict[str, DenseFormat]) -> list[str]:
    """Replace each nn.Linear named in `formats` (module name -> format) by a DenseLinear of
    that format, on the device of its parameters (meta, before loading); returns the names of
    its stored-dtype parameters. ValueError for a name that is no nn.Linear of the model."""
    kept: list[str] = []
    for name, fmt in formats.items():
        try:
            linear = model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"the store quantizes {name}, which the model does not have") from err
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"the store quantizes {name}, a {type(linear).__name__}, not a Linear")
        device = linear.weight.device
        with torch.device(device):
            quantized = DenseLinear(
                linear.in_features, linear.out_features, fmt, linear.bias is not None
            )
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, leaf, quantized)
        kept += [f"{name}.{p}" for p in ("weight", *SCALE_NAMES) if hasattr(quantized, p)]
    return kept


def fuse_dense_qkv(parts: list[nn.Module]) -> DenseLinear | None:
    """One DenseLinear over the rows of `parts` (q, k, v of one format) so that they run as one
    GEMV; the parts' parameters become views of its tensors (nothing duplicated). None where
    they cannot be fused: not all DenseLinear of one format, fp8 tiles that would straddle two
    parts, NVFP4 tensor scales that differ, or biases on some only."""
    if not all(isinstance(p, DenseLinear) for p in parts):
        return None
    linears = [p for p in parts if isinstance(p, DenseLinear)]
    fmt = linears[0].fmt
    if any(p.fmt != fmt or p.in_features != linears[0].in_features for p in linears):
        return None
    if fmt.kind == "fp8" and any(p.out_features % fmt.block[0] for p in linears[:-1]):
        return None
    if fmt.kind == "nvfp4" and any(
        not torch.equal(p.weight_scale_2, linears[0].weight_scale_2) for p in linears
    ):
        return None
    if len({p.bias is None for p in linears}) != 1:
        return None
    names = [n for n in ("weight", *SCALE_NAMES) if hasattr(linears[0], n)]
    stacked = {n: n != "weight_scale_2" for n in names}  # scale_2: one shared value
    rows = sum(p.out_features for p in linears)
    with torch.device(linears[0].weight.device):
        fused = DenseLinear(linears[0].in_features, rows, fmt, linears[0].bias is not None)
    for name in [*names, *(["bias"] if linears[0].bias is not None else [])]:
        if not stacked.get(name, True):
            setattr(fused, name, nn.Parameter(getattr(linears[0], name), requires_grad=False))
            continue
        whole = torch.cat([getattr(p, name).detach() for p in linears])
        setattr(fused, name, nn.Parameter(whole, requires_grad=False))
        start = 0
        for p in linears:
            size = getattr(p, name).shape[0]
            setattr(p, name, nn.Parameter(whole[start : start + size], requires_grad=False))
            start += size
    return fused


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight matrix of a Linear or a DenseLinear (decoded) in `dtype`."""
    if isinstance(module, DenseLinear):
        return module.dequantized(dtype)
    return cast(torch.Tensor, module.weight)
