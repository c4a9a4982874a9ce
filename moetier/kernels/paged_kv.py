"""Writing a forward's keys and values into the paged KV cache as one op (`moetier::write_pages`)
that declares the cache mutated: torch.compile then updates the cache in place. Written as plain
advanced indexing on a view of the cache, a compiled step copied the whole cache per write
(functionalisation of a mutated view of a graph input): at a 675 MB cache that was ~10 ms a step.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("moetier::write_pages", mutates_args=("cache",))
def write_pages(
    cache: torch.Tensor,
    layer: int,
    part: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Store each token's entry of layer `layer`: GQA cache [layers, 2, pages, KVH, PS, D], part
    0 (keys) or 1 (values), values [B, KVH, T, D]; MLA cache [layers, pages, PS, W], part -1,
    values [B, T, W]. page, offset [B, T] int64: where token (b, t) goes."""
    if part < 0:
        cache[layer][page, offset] = values
    else:
        cache[layer, part][page, :, offset] = values.transpose(1, 2)


@write_pages.register_fake
def _(
    cache: torch.Tensor,
    layer: int,
    part: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    values: torch.Tensor,
) -> None:
    return None
