"""`--embeddings host`: the input embedding table in pinned host RAM (`HostEmbedding`), each
step's rows gathered over PCIe by `moetier::host_gather` (kernels/host_gather.py).

`embeddings_to_host(model, device)` replaces a loaded model's `embed_tokens` (either model path)
and frees its device copy. The table is a plain attribute, not a parameter: code that infers the
model's device or dtype from its first parameter still sees the device's. A table tied to the
output head cannot move (the head reads all of it every step).
"""

from __future__ import annotations

import torch
from torch import nn

from moetier.kernels.host_gather import host_gather


class HostEmbedding(nn.Module):
    """nn.Embedding's forward over a host table: ids [...] -> [..., H] on `device`."""

    def __init__(self, table: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        self.table, self.device = table, device
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return host_gather(input_ids, self.table, self.device)

    def extra_repr(self) -> str:
        pinned = "pinned" if self.table.is_pinned() else "host"
        return f"{self.num_embeddings}, {self.embedding_dim}, {pinned} {self.table.dtype}"


def embeddings_to_host(model: nn.Module, device: torch.device) -> int:
    """Move the model's `embed_tokens` table into host RAM (pinned where CUDA is); returns its
    bytes. ValueError when the model has no such embedding or its head shares the table."""
    found = [(n, m) for n, m in model.named_modules() if n.endswith("embed_tokens")]
    if len(found) != 1 or not isinstance(found[0][1], nn.Embedding):
        raise ValueError(
            f"--embeddings host: no single embed_tokens embedding in the model {found}"
        )
    name, embedding = found[0]
    weight = embedding.weight
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is weight:
        raise ValueError(
            "--embeddings host: this model's output head is its embedding table (tied "
            "embeddings), which every step reads whole: keep --embeddings gpu"
        )
    table = weight.detach().to("cpu").contiguous()
    if torch.cuda.is_available():
        table = table.pin_memory()
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, leaf, HostEmbedding(table, device))
    return table.numel() * table.element_size()
