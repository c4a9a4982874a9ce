"""Rows of a table in pinned host RAM gathered by the GPU: `torch.ops.moetier.host_gather`.

`--embeddings host` keeps the embedding table in page-locked host memory; each step's token rows
(hidden_size × 2 bytes each, a few KB) are read by a Triton kernel over PCIe straight from that
memory (zero-copy: with unified addressing a pinned host address is valid on the device, as the
host tier's expert rows are read, docs/residency.md), into a CUDA tensor. No host sync, no
copy engine: shape-static, so it is captured in the CUDA-graph step. The kernel addresses the
table as an element offset from its output tensor (the launcher takes CUDA tensors only).
`host_gather_ref` (index_select, then a copy to the ids' device) is the CPU path and twin.
"""

from __future__ import annotations

import torch


def host_gather_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids [...] int64 on any device, table [V, H] on the host -> [..., H] on ids' device."""
    rows = table.index_select(0, ids.reshape(-1).to(table.device))
    return rows.to(ids.device).view(*ids.shape, table.shape[1])


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _host_gather_kernel(ids, out, table_offset, H, BLOCK_H: tl.constexpr):
        """out[t, :] = table[ids[t], :], the table at element offset `table_offset` from out."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        row = tl.load(ids + t).to(tl.int64)
        values = tl.load(out + table_offset + row * H + cols, mask=mask)
        tl.store(out + t * H + cols, values, mask=mask)

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


def host_gather_triton(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The kernel: ids on the GPU, table pinned (contiguous) on the host."""
    if triton is None:
        raise RuntimeError("host_gather needs triton")
    flat = ids.reshape(-1)
    vocab, hidden = table.shape
    out = torch.empty(flat.shape[0], hidden, dtype=table.dtype, device=ids.device)
    size = table.element_size()
    delta = table.data_ptr() - out.data_ptr()
    if delta % size:
        raise ValueError("host_gather: table and output are not element-aligned to each other")
    block = min(1024, triton.next_power_of_2(hidden))
    if flat.shape[0]:
        _host_gather_kernel[(flat.shape[0], triton.cdiv(hidden, block))](
            flat, out, delta // size, hidden, BLOCK_H=block
        )
    return out.view(*ids.shape, hidden)


@torch.library.custom_op("moetier::host_gather", mutates_args=())
def host_gather(ids: torch.Tensor, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows `ids` of `table` (host, pinned when `device` is CUDA) -> [..., H] on `device`."""
    if device.type == "cuda" and triton is not None and table.is_pinned():
        return host_gather_triton(ids.to(device), table)
    return host_gather_ref(ids.to(device), table)


@host_gather.register_fake
def _(ids, table, device):  # type: ignore[no-untyped-def]
    return torch.empty(*ids.shape, table.shape[1], dtype=table.dtype, device=device)
