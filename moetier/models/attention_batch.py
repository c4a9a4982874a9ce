"""Where a forward's tokens write their KV and which keys each of them sees (`AttentionBatch`),
over a paged cache: pages of `page_size` positions ([layers, 2, pages, kv_heads, page_size, D]
for GQA, [layers, pages, page_size, width] for MLA's latent cache).

The model's tokens come as rows [B, T]. Three shapes of batch, built once per forward and
shared by every layer:

- `static`: the static cache of StaticDecoder, one page of L positions per row (row b is page
  b); keys are the cache itself (a view), the mask the causal one of each row's positions.
- `decode`: one token per row, each row a sequence with its own page table [B, W]; the CUDA
  decode kernel reads the pages through the table, SDPA (CPU) gathers them.
- `packed`: every scheduled token of a step in one row [1, N] (sequences one after another,
  prefill chunks and decodes mixed); the keys are each sequence's positions gathered from its
  pages, one after another, and the mask lets a token see only its own sequence's keys up to
  its position. Or, `paged` (kernels/prefill_attention.py, GQA), each sequence's page row and
  the step's blocks of one sequence's tokens, which the kernel reads the pages through: nothing
  of tokens x context.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from moetier.kernels.paged_kv import write_kv_pages, write_pages
from moetier.kernels.prefill_attention import page_rows, prefill_blocks


@dataclass
class AttentionBatch:
    positions: torch.Tensor  # [B, T] int64: each token's position in its sequence
    write_page: torch.Tensor | None  # [B, T] int64: the page its KV goes to (None: static)
    write_offset: torch.Tensor  # [B, T] int64: the position in that page
    mask: torch.Tensor | None  # [B, 1, T, Lk] bool: the keys each token sees (None: decode kernel)
    key_page: torch.Tensor | None = None  # [B, Lk] int64: the keys' pages (None: page b = row b)
    key_offset: torch.Tensor | None = None  # [B, Lk] int64
    page_table: torch.Tensor | None = None  # [B, W] int32: decode rows' pages, for the kernel
    # a packed step read through page tables (kernels/prefill_attention.py): each sequence's
    # pages [S, W] int32 and the step's blocks of one sequence's tokens [NB, 4] int32
    seq_pages: torch.Tensor | None = None
    blocks: torch.Tensor | None = None

    @property
    def static_rows(self) -> bool:
        """Row b is page b, positions at their own index (StaticDecoder's cache)."""
        return self.write_page is None

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """One layer's cache [pages, ..., page_size, ...] laid out per row: GQA's [P, KVH, PS, D]
        -> [B, KVH, Lk, D]; MLA's [P, PS, W] -> [B, Lk, W]."""
        if self.key_page is None:
            return cache  # the static cache: page b is row b
        if cache.dim() == 4:
            return cache[self.key_page, :, self.key_offset].transpose(1, 2)
        return cache[self.key_page, self.key_offset]

    def write(self, cache: torch.Tensor, layer: int, part: int, values: torch.Tensor) -> None:
        """Store each token's entry of layer `layer` in the whole cache: GQA [layers, 2, P, KVH,
        PS, D] part 0 (keys) or 1 (values), values [B, KVH, T, D]; MLA [layers, P, PS, W] part
        -1, values [B, T, W]. Paged writes go through `moetier::write_pages` (in place under
        torch.compile)."""
        if self.write_page is None:  # static rows: a scatter along the positions
            view = cache[layer] if part < 0 else cache[layer, part]
            if view.dim() == 4:
                index = self.positions[:, None, :, None].expand_as(values)
                view.scatter_(2, index, values)
            else:
                view.scatter_(1, self.positions[:, :, None].expand_as(values), values)
            return
        write_pages(cache, layer, part, self.write_page, self.write_offset, values)

    def write_kv(self, cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A GQA layer's keys and values [B, KVH, T, D] (`write` for parts 0 and 1); paged rows
        in one op (`moetier::write_kv_pages`)."""
        if self.write_page is None:
            self.write(cache, layer, 0, k)
            self.write(cache, layer, 1, v)
            return
        write_kv_pages(cache, layer, self.write_page, self.write_offset, k, v)

    @staticmethod
    def static(positions: torch.Tensor, max_len: int) -> AttentionBatch:
        """Row b is page b of max_len positions (StaticDecoder's cache): entries scattered at
        their positions, keys the cache itself, the decode kernel without a page table."""
        visible = torch.arange(max_len, device=positions.device)
        mask = visible[None, None, None, :] <= positions[:, None, :, None]
        return AttentionBatch(positions, None, positions, mask)

    @staticmethod
    def decode(
        positions: torch.Tensor, page_table: torch.Tensor, page_size: int, with_keys: bool
    ) -> AttentionBatch:
        """One token per row: positions [B, 1], page_table [B, W] int32. with_keys: also the
        gathered keys and mask for SDPA (CPU); without, only the decode kernel can attend."""
        device = positions.device
        pos = positions[:, 0]
        write_page = page_table.long().gather(1, (pos // page_size)[:, None])
        batch = AttentionBatch(
            positions, write_page, positions % page_size, None, page_table=page_table
        )
        if with_keys:
            width = page_table.shape[1]
            offsets = torch.arange(page_size, device=device).repeat(width)  # [W * PS]
            batch.key_page = page_table.long().repeat_interleave(page_size, dim=1)
            batch.key_offset = offsets[None].expand(page_table.shape[0], -1)
            visible = torch.arange(width * page_size, device=device)[None, :] <= pos[:, None]
            batch.mask = visible[:, None, None, :]
        return batch

    @staticmethod
    def packed(
        spans: Sequence[tuple[int, int, Sequence[int]]],
        page_size: int,
        device: torch.device | str,
        paged: bool = False,
    ) -> AttentionBatch:
        """Sequences one after another in one row: spans (start, count, pages): positions
        [start, start + count) of a sequence whose KV lives in `pages` (positions before start
        already there). -> a batch of B = 1, T = sum of counts. Built with array operations: a
        chunk over a long cached prefix costs the host little more than one without (the keys,
        every position up to the chunk's end, were a Python loop over the whole context).
        paged: the tables of the paged prefill kernel (`seq_pages`, `blocks`) instead of the
        gathered keys and the mask (None), which would grow with tokens x context."""
        starts = np.array([start for start, _, _ in spans], dtype=np.int64)
        counts = np.array([count for _, count, _ in spans], dtype=np.int64)
        ends = starts + counts
        held = np.array([len(pages) for _, _, pages in spans], dtype=np.int64)
        for end, pages_held in zip(ends.tolist(), held.tolist(), strict=True):
            if pages_held * page_size < end:
                raise ValueError(f"{pages_held} pages cannot hold {end} positions")
        # every sequence's pages one after another; first[seq]: where its own begin
        flat = np.fromiter(
            itertools.chain.from_iterable(pages for _, _, pages in spans),
            dtype=np.int64,
            count=int(held.sum()),
        )
        first = np.cumsum(held) - held
        seqs = np.arange(len(spans), dtype=np.int64)
        query_seq = np.repeat(seqs, counts)
        positions = _ranges(counts) + np.repeat(starts, counts)
        write_page = flat[first[query_seq] + positions // page_size]

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device)[None]

        pos = tensor(positions)
        if paged:  # the kernel's tables: no keys or mask of tokens x context
            widths = (-(-ends // page_size)).tolist()
            table = page_rows([pages for _, _, pages in spans], widths)
            blocks = prefill_blocks(starts.tolist(), counts.tolist())
            return AttentionBatch(
                pos, tensor(write_page), pos % page_size, None,
                seq_pages=torch.from_numpy(table).to(device),
                blocks=torch.from_numpy(blocks).to(device),
            )  # fmt: skip
        key_seq = np.repeat(seqs, ends)
        key_pos = _ranges(ends)
        key_page = flat[first[key_seq] + key_pos // page_size]
        same = tensor(query_seq)[0][:, None] == tensor(key_seq)[0][None, :]
        causal = tensor(key_pos)[0][None, :] <= pos[0][:, None]
        mask = (same & causal)[None, None]  # [1, 1, N, Lk]
        return AttentionBatch(
            pos, tensor(write_page), pos % page_size, mask, tensor(key_page),
            tensor(key_pos % page_size),
        )  # fmt: skip

    def head_folded(self, heads: int) -> AttentionBatch:
        """The batch of MLAttention, whose heads share one latent key: the mask [B, 1, T, Lk]
        -> [B, 1, heads * T, Lk], row h * T + t = token t of head h."""
        if self.mask is None:
            return self
        batch, _, tokens, length = self.mask.shape
        folded = self.mask[:, :, None].expand(batch, 1, heads, tokens, length)
        return replace(self, mask=folded.reshape(batch, 1, -1, length))


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """0 .. n - 1 for each n of `lengths`, one after another."""
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(lengths) - lengths, lengths
    )
