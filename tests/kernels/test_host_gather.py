"""`--embeddings host` (#52 item 3): the gather kernel against index_select, the loaded model
with its table on the host against the same model with it on the device, the planner's split,
and on the GPU (marked `gpu`) the zero-copy read inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.kernels.host_gather import host_gather, host_gather_ref, host_gather_triton
from moetier.loader.load import load_model
from moetier.models.host_embedding import HostEmbedding, embeddings_to_host
from moetier.quant.store import Store
from moetier.residency.planner import plan


def test_gather_kernel_is_index_select():
    """Under Triton's interpreter on CPU: the table addressed from the output tensor."""
    table = torch.randn(50, 40, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    out = host_gather_triton(ids, table)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, table[ids])
    assert torch.equal(host_gather_ref(ids, table), table[ids])
    assert torch.equal(host_gather(ids, table, torch.device("cpu")), table[ids])


@pytest.mark.parametrize("native", [True, False], ids=["native", "transformers"])
def test_host_table_gives_the_same_logits(tiny, native):
    store = tiny.store("qwen3_moe")
    config = dict(device="cpu", dtype="float32", native=native)
    on_device = load_model(store, EngineConfig(**config))
    on_host = load_model(store, EngineConfig(**config, embeddings="host"))
    modules = [m for m in on_host.model.modules() if isinstance(m, HostEmbedding)]
    assert len(modules) == 1 and modules[0].table.device.type == "cpu"
    assert not any(isinstance(m, torch.nn.Embedding) for m in on_host.model.modules())
    ids = torch.randint(1, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if native:
            outs = []
            for loaded in (on_device, on_host):
                cache = loaded.model.new_cache(2, 32, torch.float32, "cpu")
                outs.append(loaded.model(ids, torch.arange(9).expand(2, -1), cache))
        else:
            outs = [on_device.model(ids).logits, on_host.model(ids).logits]
    assert torch.equal(*outs)


def test_tied_table_stays(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", dtype="float32"))
    model = loaded.model
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them
    with pytest.raises(ValueError, match="tied embeddings"):
        embeddings_to_host(model, torch.device("cpu"))


def test_planner_moves_the_table_to_the_host(tiny):
    store = Store(tiny.store("qwen3_moe"))
    embed = store.dense_bytes_by_class(2)["embed"]
    full = plan(store, 2**40)
    gpu = full.dense_bytes + full.kv_bytes + full.workspace_bytes + 3 * full.slot_bytes
    on_gpu = plan(store, gpu, 2**20)
    on_host = plan(store, gpu, 2**20, embeddings_host=True)
    assert on_gpu.gpu_base_slots == 3 and on_host.gpu_base_slots > 3  # the table's room
    assert on_gpu.dense_bytes - on_host.dense_bytes == embed
    assert on_host.host_embedding_bytes == embed
    # the host budget holds the table first, then expert blobs
    left = len(store.blobs) - on_host.gpu_base_slots - on_host.gpu_delta_slots
    assert on_host.host_blobs == min(left, (2**20 - embed) // on_host.slot_bytes)
    assert "embedding table" in on_host.render()
    with pytest.raises(ValueError, match="does not fit --host-memory"):
        plan(store, 2**30, embed - 1, embeddings_host=True)


@pytest.mark.gpu
def test_gpu_zero_copy_gather_in_a_cuda_graph():
    table = torch.randn(151936, 2048, dtype=torch.bfloat16).pin_memory()
    ids = torch.randint(0, 151936, (8,), device="cuda")
    graph = torch.cuda.CUDAGraph()
    out = host_gather(ids, table, torch.device("cuda"))  # compiles outside the capture
    with torch.cuda.graph(graph):
        out = host_gather(ids, table, torch.device("cuda"))
    ids.copy_(torch.randint(0, 151936, (8,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert out.is_cuda and torch.equal(out.cpu(), table[ids.cpu()])
