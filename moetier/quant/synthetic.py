"""Random but valid expert blobs of any format, written directly in their stored form.

For kernel tests and benchmarks at shapes no real checkpoint is at hand for: every byte pattern
of the codes is legal, scales are drawn in a realistic range, so a decoder that misreads any
field is caught. Never materialises unquantized weights.
"""

from __future__ import annotations

import torch

from moetier.core.layout import DTYPES, BlobFormat, format_kind


def random_blob(
    fmt: BlobFormat,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
    fitted_grid: bool = True,
) -> torch.Tensor:
    """One blob of `fmt` (uint8 [fmt.nbytes], or written into `out`, a uint8 view of at least
    that size on any device) with random codes and plausible scales. q2s grids (a, b) are drawn
    freely (`fitted_grid`) or with b = 3a, the evenly spaced grid the quantizer uses today."""
    blob = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    kind = format_kind(fmt)
    for spec in fmt.tensors:
        shape, dtype = spec.shape, DTYPES[spec.dtype]
        leaf = spec.name.rsplit(".", 1)[-1]
        if kind == "mxfp4" and leaf == "scales":
            value = torch.randint(118, 128, shape, generator=generator, dtype=torch.uint8)
        elif dtype == torch.uint8:
            value = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        elif leaf in ("scales", "row_scale", "tensor_scale"):
            value = (torch.rand(shape, generator=generator) * 1.5 + 0.25).to(dtype)
        elif leaf == "grid":  # q2s (a, b) with 0 < a < b
            a = float(torch.rand((), generator=generator)) * 0.4 + 0.3
            ratio = 2.5 + float(torch.rand((), generator=generator)) if fitted_grid else 3.0
            value = torch.tensor([a, a * ratio])
        elif leaf == "table":  # nested: mean E2M1 value of each (sign, exponent MSB) code
            value = torch.tensor([0.75, 3.75, -0.75, -3.75]) * (
                1 + 0.1 * torch.randn(4, generator=generator)
            )
        else:  # raw matrices and biases
            value = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
        raw = value.contiguous().view(-1).view(torch.uint8)
        blob[spec.offset : spec.offset + spec.nbytes] = raw
    if out is None:
        return blob
    out[: blob.numel()].copy_(blob)
    return out
