"""KV-cache pages and the prefix cache, as bookkeeping only (no tensors).

The KV cache is `num_pages` fixed-size pages of `page_size` token positions; a request holds a
list of pages (its page table). A page is full when all its positions hold computed KV; a full
page is keyed by a hash of its tokens chained with every token before it (`page_hashes`), so
two requests with the same first N·page_size tokens share their first N pages.

Pages are reference-counted. A page whose count drops to zero goes on the free queue but keeps
its hash: it can still be reused as a cached prefix until it is handed out again. Allocation
takes the least recently freed page first (and then forgets its hash), so the prefix cache
evicts least-recently-used unreferenced pages first. A request frees its pages last to first,
so the tail of a conversation is evicted before its head.

With an MTP layer (speculative decoding) a page also holds the layer's KV, and the entry at its
last position depends on the token after the page (the layer at position p reads the token at
p + 1): such a page is keyed by its hash and that token (`next_token_key`), and enters the
cache only once the layer's KV of all its positions is written (engine/scheduler.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT_HASH = b"moetier-kv-pages"


def page_hashes(tokens: Sequence[int], page_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The chained hash of every full page of `tokens`: hash[i] covers tokens[: (i+1)·page_size].
    `known` are hashes already computed for the first pages (extended, not recomputed)."""
    hashes = list(known)
    done, full = len(hashes), len(tokens) // page_size
    if full <= done:
        return hashes
    # each token as 4 bytes, little-endian (one pack for all the new pages: a long prompt's
    # admission hashes every page of it)
    data = struct.pack(
        f"<{(full - done) * page_size}I", *tokens[done * page_size : full * page_size]
    )
    width = 4 * page_size
    for i in range(full - done):
        parent = hashes[-1] if hashes else ROOT_HASH
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(data[i * width : (i + 1) * width])
        hashes.append(digest.digest())
    return hashes


def next_token_key(page_hash: bytes, next_token: int) -> bytes:
    """The cache key of a full page whose contents also depend on the token after it (an MTP
    layer's KV at the page's last position): its chained hash and that token."""
    digest = hashlib.blake2b(page_hash, digest_size=16)
    digest.update(struct.pack("<I", next_token))
    return digest.digest()


@dataclass
class PageStats:
    """Counters of the prefix cache, for /metrics."""

    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of them, found in cached pages
    evicted_pages: int = 0  # cached pages handed out again (their hash forgotten)


@dataclass
class PagePool:
    """`num_pages` pages of `page_size` positions: allocation, reference counts, free queue and
    the prefix cache over it."""

    num_pages: int
    page_size: int
    prefix_caching: bool = True
    stats: PageStats = field(default_factory=PageStats)

    def __post_init__(self) -> None:
        if self.num_pages < 1 or self.page_size < 1:
            raise ValueError(f"a KV cache of {self.num_pages} pages of {self.page_size}")
        self._refs = [0] * self.num_pages
        self._hash_of: list[bytes | None] = [None] * self.num_pages
        self._page_of: dict[bytes, int] = {}
        # unreferenced pages, least recently freed first (dict order; O(1) removal)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_pages))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` positions."""
        return -(-tokens // self.page_size)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh pages (reference count 1), or None (nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        pages = []
        for _ in range(count):
            page, _ = self._free.popitem(last=False)
            if (old := self._hash_of[page]) is not None:
                del self._page_of[old]
                self._hash_of[page] = None
                self.stats.evicted_pages += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page, last to first; unreferenced pages go to the free
        queue's end (a cached one stays reusable until handed out again)."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} freed more often than taken")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest cached run of `hashes` from the first (not referenced by
        this call: `take` them to use them)."""
        pages = []
        if self.prefix_caching:
            for h in hashes:
                page = self._page_of.get(h)
                if page is None:
                    break
                pages.append(page)
        return pages

    def take(self, pages: Sequence[int]) -> None:
        """Add a reference to each of `pages` (cached pages a request now uses)."""
        for page in pages:
            if self._refs[page] == 0:
                del self._free[page]
            self._refs[page] += 1

    def record_hits(self, queried: int, hit: int) -> None:
        self.stats.queried_tokens += queried
        self.stats.hit_tokens += hit

    def commit(self, pages: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Key each full page by its hash (pages[i] holds the tokens hashes[i] ends with).
        A hash already cached on another page keeps that page; this one stays uncached."""
        if not self.prefix_caching:
            return
        for page, h in zip(pages, hashes, strict=False):
            if self._hash_of[page] is not None or h in self._page_of:
                continue
            self._hash_of[page] = h
            self._page_of[h] = page
