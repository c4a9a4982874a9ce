"""Zero-copy mode: hot blobs in GPU slots, the rest read from host rows through signed 64-bit
slot offsets; same logits as a full cache, before and after promotions."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig, ExpertActivation
from moetier.kernels.moe_ref import moe_slots_ref
from moetier.loader.load import load_model


def load(tiny, **engine):
    return load_model(
        tiny.store("qwen3_moe"), EngineConfig(native=False, device="cpu", dtype="float32", **engine)
    )


def logits(loaded, ids):
    with torch.no_grad():
        return loaded.model(ids).logits


def test_zero_copy_is_bit_identical_and_promotes(tiny):
    ids = torch.randint(1, 300, (2, 7), generator=torch.Generator().manual_seed(4))
    full = logits(load(tiny), ids)
    loaded = load(tiny, expert_cache_slots=4, host_memory="64MiB")
    zc = loaded.runtime.enable_zero_copy()
    table_ptr = zc.table.data_ptr()
    # 4 of 16 base blobs on the "GPU"; the others addressed in the host arenas
    assert int((zc.table < zc.slots).sum()) == 4 and int((zc.table >= zc.slots).sum()) == 12
    assert torch.equal(logits(loaded, ids), full)
    pairs = 2 * 7 * loaded.model_config.top_k * len(zc.layers)
    assert int(zc.counts.sum()) == pairs
    counts = zc.counts.clone()
    copied = zc.rebalance()
    on_gpu = zc.table < zc.slots  # [layers, E]
    assert int(on_gpu.sum()) == 4 and counts[on_gpu].min() >= counts[~on_gpu].max()
    assert copied > 0 and zc.table.data_ptr() == table_ptr  # in place
    assert torch.equal(logits(loaded, ids), full)
    telemetry = loaded.runtime.telemetry()
    assert telemetry["gpu"].hits + telemetry["gpu"].misses == 2 * pairs
    assert telemetry["gpu"].hits == int(zc.gpu_pairs) > 0


def test_zero_copy_needs_the_host_tier(tiny):
    with pytest.raises(ValueError, match="zero-copy mode reads blobs from the host tier"):
        load(tiny, expert_cache_slots=4).runtime.enable_zero_copy()
    blob = load(tiny).runtime.residency.slot_bytes
    small = load(tiny, expert_cache_slots=4, host_memory=f"{10 * blob}B")
    with pytest.raises(ValueError, match="6 blobs are not in it and the GPU holds 4"):
        small.runtime.enable_zero_copy()
    pinned = load(tiny)
    pinned.runtime.pin_all()
    with pytest.raises(ValueError, match="zero-copy mode replaces pin_all"):
        pinned.runtime.enable_zero_copy()


def test_kernel_reads_host_rows_at_negative_and_far_offsets(tiny):
    """The Triton kernel (interpreter on CPU) adds signed int64 offsets to the pool pointer: host
    rows below the pool (negative offsets) and far above it are read as their bytes say, the
    same figures as the reference kernel over the rows gathered into one pool."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test of CPU tensors; on CUDA the gpu tests below cover it")
    triton = pytest.importorskip("triton")  # noqa: F841
    from moetier.kernels.moe_triton import moe_slots_triton

    runtime = load(tiny).runtime
    store, layer = runtime.residency.store, runtime.residency.store.moe_layers[0]
    fmt, experts = runtime.formats[layer], store.model_config.num_experts
    slot = runtime.residency.slot_bytes
    # one buffer: rows 0..E-1 "host" (below the pool), the pool after a gap, then more host rows
    buffer = torch.zeros(3 * experts + 64, slot, dtype=torch.uint8)
    pool = buffer[experts + 32 : 2 * experts + 32]
    below, above = buffer[:experts], buffer[2 * experts + 64 :]
    gathered = torch.zeros(experts, slot, dtype=torch.uint8)
    offsets = torch.zeros(experts, dtype=torch.int64)
    for e in range(experts):
        blob = store.blob(layer, e)
        gathered[e, : blob.numel()] = blob
        row = (below if e % 2 else above)[e]
        row[: blob.numel()] = blob
        offsets[e] = row.data_ptr() - pool.data_ptr()
    assert (offsets < 0).sum() == experts // 2 and (offsets >= pool.numel()).sum() == experts // 2
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, store.model_config.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(3)])
    weights = torch.rand(3, 2, generator=gen)
    table = torch.arange(experts, dtype=torch.int32)
    act = ExpertActivation(kind="silu")
    want = torch.zeros(3, 2, hidden.shape[1])
    moe_slots_ref(hidden, ids, weights, table, gathered, fmt, act, want)
    got = torch.zeros_like(want)
    moe_slots_triton(hidden, ids, weights, table, pool, fmt, act, got, slot_offsets=offsets)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def graph_decode(loaded, prompt: list[int], steps: int, rebalance_at: int = -1) -> torch.Tensor:
    """Greedy decode replayed from one CUDA graph of the step; logits [steps, V]. With
    `rebalance_at`, the zero-copy placement is rebalanced between two replays."""
    from moetier.engine.static_decode import StaticDecoder

    dec = StaticDecoder(loaded.model, 1, 64, torch.float32, "cuda")
    with torch.inference_mode():
        dec.input_ids.copy_(dec.prefill([prompt]).argmax(-1)[:, None])
        replay = dec.capture(greedy=True)
        outs = []
        for step in range(steps):
            if step == rebalance_at:
                loaded.runtime.zero_copy.rebalance()
            outs.append(replay().clone())
    return torch.cat(outs)


@pytest.mark.gpu
def test_zero_copy_decode_replays_from_a_cuda_graph(tiny):
    """The zero-copy step captures (no host sync), reads host rows through the kernel, and a
    rebalance between replays (tables rewritten in place) keeps the logits of a fully pinned
    model, bit for bit."""
    store = tiny.store("qwen3_moe")

    def native(**engine):
        config = EngineConfig(device="cuda", dtype="float32", native=True, **engine)
        return load_model(store, config)

    pinned = native()
    pinned.runtime.pin_all()
    want = graph_decode(pinned, [5, 17, 33], 8)
    zero_copy = native(expert_cache_slots=4, host_memory="64MiB")
    placement = zero_copy.runtime.enable_zero_copy()
    assert zero_copy.runtime.residency.host.pinned
    assert (placement.offsets[placement.slots :] < 0).any() or (
        placement.offsets[placement.slots :] >= zero_copy.runtime.residency.pool.numel()
    ).all()  # host rows lie outside the pool
    got = graph_decode(zero_copy, [5, 17, 33], 8, rebalance_at=4)
    assert torch.equal(got, want)
    # the replays counted pairs on the device, and the rebalance placed the top-scored blobs
    assert placement.scores.sum() > 0
    pool = zero_copy.runtime.residency
    hot = [*placement.fixed, *placement.hot_keys(placement.scores)][: pool.capacity]
    assert set(pool.resident()) == set(hot)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_long_prompt_streams_instead_of_reading_host_rows(tiny, device):
    """In zero-copy mode a call of >= stream_tokens tokens streams each layer's experts into
    the slots once (the grouped kernel would read host rows several times): the tables point
    at host rows meanwhile (decode stays correct without a rebalance), the counts still feed
    the rebalance that puts the hot set back; logits bit-identical throughout."""
    store = tiny.store("qwen3_moe")

    def native(**engine):
        config = EngineConfig(device=device, dtype="float32", native=True, **engine)
        return load_model(store, config)

    def run(loaded, prompt, steps, between=None):
        cache = loaded.model.new_cache(1, 64, torch.float32, device)
        outs = []
        with torch.no_grad():
            positions = torch.arange(prompt.shape[1], device=device)[None]
            out = loaded.model(prompt, positions, cache)
            for t in range(prompt.shape[1], prompt.shape[1] + steps):
                outs.append(out)
                if between is not None:
                    between(t - prompt.shape[1])
                position = torch.tensor([[t]], device=device)
                out = loaded.model(out[:, -1:].argmax(-1), position, cache)
            outs.append(out)
        return torch.cat(outs, dim=1)

    prompt = torch.randint(1, 300, (1, 24), generator=torch.Generator().manual_seed(8))
    prompt = prompt.to(device)
    want = run(native(), prompt, 4)
    loaded = native(expert_cache_slots=4, host_memory="64MiB")
    runtime = loaded.runtime
    runtime.stream_tokens = 16
    zc = runtime.enable_zero_copy()
    table_ptr = zc.table.data_ptr()
    placed_bytes = runtime.residency.stats.bytes_fetched
    seen = {}

    def between(step):
        if step == 0:  # right after the prompt: streamed, tables at host rows
            seen["demoted"], seen["on_gpu"] = zc.demoted, int((zc.table < zc.slots).sum())
            stats = runtime.residency.stats
            seen["copied"] = stats.bytes_fetched - placed_bytes
            seen["requests"], seen["streamed"] = stats.hits + stats.misses, zc.streamed_pairs
        if step == 2:  # the Generator's rebalance (here after one decode step at host rows)
            zc.rebalance()

    assert torch.equal(run(loaded, prompt, 4, between), want)
    top_k, layers = loaded.model_config.top_k, len(zc.layers)
    # the stream asked the pool for each layer's distinct experts and copied blobs in
    assert seen["demoted"] and seen["on_gpu"] == 0 and seen["requests"] > 0 and seen["copied"] > 0
    assert seen["streamed"] == 24 * top_k * layers
    assert not zc.demoted and int((zc.table < zc.slots).sum()) == 4
    assert zc.table.data_ptr() == table_ptr
    # counts cover the prompt (for the rebalance) and the 4 decode steps
    assert int(zc.counts.sum()) == (24 + 4) * top_k * layers
    gpu = runtime.telemetry()["gpu"]
    stats = runtime.residency.stats  # the stream's blob requests, then 4 zero-copy steps' pairs
    assert gpu.hits + gpu.misses == stats.hits + stats.misses + 4 * top_k * layers


@pytest.mark.parametrize("guess_from", ["input", "output"])
@pytest.mark.parametrize(
    ("device", "model_type"),
    [("cpu", "qwen3_moe"), ("cpu", "deepseek_v3"),
     pytest.param("cuda", "qwen3_moe", marks=pytest.mark.gpu)],
)  # fmt: skip
def test_staged_guesses_keep_decode_bit_identical(tiny, device, model_type, guess_from):
    """Zero-copy with staging slots: each one-token step copies the next layer's best guesses
    (its router on this layer's input, or on the residual after the layer: `guess_from`) from
    host rows into staging slots and points the table
    at them (on CUDA on a side stream, joined before the next layer; captured in the CUDA
    graph): logits stay those of a fully pinned model, bit for bit, and the guesses were
    really staged and read."""
    from moetier.models.experts import router_weights

    store = tiny.store(model_type)  # deepseek_v3: its sigmoid router guesses without its bias

    def native(**engine):
        config = EngineConfig(device=device, dtype="float32", native=True, **engine)
        return load_model(store, config)

    def decode(loaded, prompt, steps):
        if device == "cuda":
            return graph_decode(loaded, prompt, steps)
        cache = loaded.model.new_cache(1, 64, torch.float32, device)
        ids = torch.tensor([prompt])
        positions = torch.arange(len(prompt))[None]
        outs = []
        with torch.no_grad():
            logits = loaded.model(ids, positions, cache)[:, -1]
            for step in range(steps):
                token = logits.argmax(-1)[:, None]
                position = torch.tensor([[len(prompt) + step]])
                logits = loaded.model(token, position, cache)[:, -1]
                outs.append(logits)
        return torch.cat(outs)

    pinned = native()
    pinned.runtime.pin_all()
    want = decode(pinned, [5, 17, 33], 8)
    staged = native(expert_cache_slots=6, host_memory="64MiB")
    runtime = staged.runtime
    zc = runtime.enable_zero_copy(hot=[], stage=2)  # 2 MoE layers x 2 staging slots
    assert runtime.residency.capacity == 2 and zc.stage_first == 2
    routers, norms = router_weights(staged.model, sorted(runtime.formats))
    runtime.enable_prefetch(routers, norms, guess_from=guess_from)
    got = decode(staged, [5, 17, 33], 8)
    assert torch.equal(got, want)
    # every step staged 2 guesses for the second MoE layer, and some of them were used: with
    # no blob cached, every GPU hit is a read from a staging slot
    assert int(zc.staged_blobs) >= 2 * 8 and int(zc.gpu_pairs) > 0
    staged_now = zc.table[1][zc.staged[1].long()]
    assert (zc.staged[1] >= 0).all() and torch.equal(staged_now, zc.staging[1])
    # telemetry: the guesses are the gpu tier's prefetches
    gpu = runtime.telemetry()["gpu"]
    assert gpu.prefetch_issued == int(zc.staged_blobs) and gpu.prefetch_used == int(zc.staged_pairs)
    assert 0 < gpu.prefetch_used <= gpu.prefetch_needed and 0 < gpu.prefetch_precision <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("guess_from", ["input", "output"])
def test_staged_zero_copy_step_compiles_into_one_graph(tiny, guess_from):
    """The zero-copy one-token step with staging traces into one torch.compile graph (the
    staging ops inside it): a graph break in the experts runtime (once, `bool` of a dict, which
    torch 2.11's dynamo cannot trace) made dynamo run the decoder's layer loop eagerly."""
    from moetier.models.experts import router_weights

    store = tiny.store("qwen3_moe")
    config = EngineConfig(device="cuda", dtype="float32", native=True, expert_cache_slots=6,
                          host_memory="64MiB")  # fmt: skip
    loaded = load_model(store, config)
    runtime = loaded.runtime
    runtime.enable_zero_copy(hot=[], stage=2)
    routers, norms = router_weights(loaded.model, sorted(runtime.formats))
    runtime.enable_prefetch(routers, norms, guess_from=guess_from)
    cache = loaded.model.new_cache(1, 16, torch.float32, "cuda")
    ids, positions = torch.tensor([[5]], device="cuda"), torch.tensor([[0]], device="cuda")
    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(loaded.model)(ids, positions, cache)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_guess_source_is_checked(tiny):
    from moetier.models.experts import router_weights

    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    with pytest.raises(ValueError, match="guess_from"):
        loaded.runtime.enable_prefetch(
            *router_weights(loaded.model, sorted(loaded.runtime.formats)), guess_from="residual"
        )


@pytest.fixture(scope="module")
def delta_store(tiny, tmp_path_factory):
    from moetier.loader.quantize import convert_quantized

    path = tmp_path_factory.mktemp("zc-delta") / "delta"
    convert_quantized(tiny.checkpoint("qwen3_moe"), path, delta="nvfp4", progress=False)
    return path


def test_delta_cache_keeps_the_most_applied_deltas(delta_store):
    """--delta-memory: of 6 slots, 2 hold delta blobs only, those the gate applied most
    (counted on the device), the other 4 the most used base blobs; logits bit-identical to a
    cache that holds everything."""
    config = dict(native=False, device="cpu", dtype="float32", delta="weight:0.15")
    ids = torch.randint(1, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    full = logits(load_model(delta_store, EngineConfig(**config)), ids)
    loaded = load_model(
        delta_store, EngineConfig(**config, expert_cache_slots=6, host_memory="64MiB")
    )
    zc = loaded.runtime.enable_zero_copy(delta_slots=2)
    assert torch.equal(logits(loaded, ids), full)
    applied = zc.delta_counts.clone()
    assert 0 < int(applied.sum()) < int(zc.counts.sum())  # the gate applied some deltas
    zc.rebalance()
    resident = loaded.runtime.residency.resident()
    deltas = [k for k in resident if k[2] == "delta"]
    bases = [k for k in resident if k[2] == "base"]
    assert len(deltas) == 2 and len(bases) == 4
    on = torch.zeros_like(applied, dtype=torch.bool)
    for layer, e, _ in deltas:
        on[zc.layer_index[layer], e] = True
    assert applied[on].min() >= applied[~on].max()  # the two most applied
    assert (
        bool((zc.delta_table < zc.slots)[on].all()) and int((zc.delta_table < zc.slots).sum()) == 2
    )
    assert torch.equal(logits(loaded, ids), full)
    with pytest.raises(ValueError, match="asks for 7 expert slots of the 6"):
        load_model(
            delta_store, EngineConfig(**config, expert_cache_slots=6, host_memory="64MiB")
        ).runtime.enable_zero_copy(delta_slots=7)


@pytest.mark.gpu
def test_delta_cache_in_the_serving_engines_graphs(delta_store):
    """`--delta-memory` through the serving engine on CUDA: the graphs' zero-copy placement
    gets a delta cache of the asked slots, and greedy text equals a cache holding everything."""
    from moetier.engine.engine import Engine, EngineLimits
    from moetier.engine.sampler import SamplingParams

    config = dict(native=True, device="cuda", dtype="float32", delta="weight:0.15")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)

    def text(loaded):
        engine = Engine(loaded, EngineLimits(num_pages=64, page_size=16, max_num_seqs=4))
        for i, prompt in enumerate([[5, 9, 13], [40, 41, 42, 43, 44]]):
            engine.add(f"r{i}", prompt, greedy)
        out = {"r0": [], "r1": []}
        while engine.has_work:
            for o in engine.step():
                out[o.request_id] += o.token_ids
        return out

    want = text(load_model(delta_store, EngineConfig(**config)))
    probe = load_model(delta_store, EngineConfig(**config, expert_cache_slots=6))
    two = 2 * probe.runtime.residency.slot_bytes
    cache = dict(expert_cache_slots=6, host_memory="64MiB", delta_memory=f"{two}B")
    loaded = load_model(delta_store, EngineConfig(**config, **cache))
    assert text(loaded) == want
    zc = loaded.runtime.zero_copy
    assert zc is not None and zc.delta_slots == 2
    assert int(zc.delta_counts.sum()) > 0


def test_preferred_layers_take_the_gpu_slots_first(tiny, monkeypatch):
    """An MTP layer's experts (`preferred`) hold GPU slots whatever the counts, while they fit
    PREFERRED_SHARE of them; beyond it they are ranked with the others. Logits unchanged."""
    from moetier.residency import zero_copy

    ids = torch.randint(1, 300, (2, 7), generator=torch.Generator().manual_seed(4))
    full = logits(load(tiny), ids)
    for share, preferred in ((1.0, True), (zero_copy.PREFERRED_SHARE, False)):
        monkeypatch.setattr(zero_copy, "PREFERRED_SHARE", share)
        loaded = load(tiny, expert_cache_slots=8, host_memory="64MiB")
        layer = max(loaded.runtime.formats)  # stands for an MTP layer (8 experts, 8 slots)
        monkeypatch.setattr(loaded.runtime.residency.store, "mtp_modules", {layer: None})
        zc = loaded.runtime.enable_zero_copy()
        row = zc.layer_index[layer]
        for _ in range(2):  # as placed, then after a rebalance by the counts
            assert torch.equal(logits(loaded, ids), full)
            on_gpu = zc.table < zc.slots
            assert int(on_gpu.sum()) == 8
            assert bool(on_gpu[row].all()) == preferred
            zc.rebalance()
        if not preferred:  # ranked by the counts like every other layer
            assert zc.counts[on_gpu].min() >= zc.counts[~on_gpu].max()
