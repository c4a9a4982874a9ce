"""The gate's `act` term (docs/gate.md): the down delta's sketch scored on each pair's base hidden
activation inside the experts op. The rule's mask against a plain torch computation of
w²‖S h‖² >= T, the Triton path (its own two launches, then the masked-delta kernels) against
moe_ref in the interpreter, the sketch file and its command, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moetier.config import DeltaRule, EngineConfig, ExpertActivation
from moetier.core.layout import TENSOR_ALIGN, align_up, fp4_expert_format, q2s_expert_format
from moetier.gate.policies import GateInputs, decide, decide_act
from moetier.gate.sketches import compute_sketches, read_sketches, top_directions
from moetier.gate.state import Gate
from moetier.kernels.moe_ref import expert_matrix, expert_matrix_with_delta, moe_slots_ref
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.quant.synthetic import random_blob

HIDDEN, INTER, EXPERTS, RANK = 64, 32, 6, 4


def synthetic(seed=0, bias=False):
    """A pool of q2s experts with NVFP4 deltas (expert 5 without one), their sketches [E, R, I]
    and the decoded (gate_up, down delta) per expert."""
    gen = torch.Generator().manual_seed(seed)
    fmt = q2s_expert_format(HIDDEN, INTER, bias, 32, 16)
    dfmt = fp4_expert_format("nvfp4", HIDDEN, INTER, False)
    slot_bytes = align_up(max(fmt.nbytes, dfmt.nbytes), TENSOR_ALIGN)
    pool = torch.zeros(2 * EXPERTS, slot_bytes, dtype=torch.uint8)
    table = torch.arange(EXPERTS, dtype=torch.int32)
    dtable = torch.arange(EXPERTS, 2 * EXPERTS, dtype=torch.int32)
    dtable[5] = -1
    sketch = torch.zeros(EXPERTS, RANK, INTER)
    for e in range(EXPERTS):
        random_blob(fmt, gen, pool[e], fitted_grid=e % 2 == 0)
        random_blob(dfmt, gen, pool[EXPERTS + e])
        ddown = expert_matrix_with_delta(pool[e], fmt, pool[EXPERTS + e], dfmt, "down")
        sketch[e] = top_directions(ddown - expert_matrix(pool[e], fmt, "down"), RANK)
    return fmt, dfmt, pool, table, dtable, sketch


def routing(tokens, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    return ids, w, x


def plain_scores(fmt, pool, ids, w, x, sketch):
    """w² ‖S_e h‖², h = silu(G x) · (U x) on the base weights, by plain torch."""
    out = torch.zeros(ids.shape)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (expert_matrix(pool[e], fmt, "gate_up") @ x[t]).chunk(2)
            h = F.silu(g) * u
            out[t, j] = w[t, j] ** 2 * (sketch[e] @ h).pow(2).sum()
    return out


def test_grammar():
    rule = DeltaRule.parse("weight*weight*act:0.5")
    assert rule is not None and rule.terms() == {"weight", "act"} and rule.threshold == 0.5
    assert DeltaRule.parse("resident:weight*act@/tmp/s.safetensors+forced:1") is not None
    with pytest.raises(ValueError, match="threshold form"):
        DeltaRule.parse("budget:0.25:weight*act")
    with pytest.raises(ValueError, match="once per product"):
        DeltaRule.parse("act*act:1")


def test_mask_is_w2_sketch_energy_over_threshold():
    fmt, dfmt, pool, table, dtable, sketch = synthetic()
    ids, w, x = routing(9, 3, seed=1)
    plain = plain_scores(fmt, pool, ids, w, x, sketch)
    threshold = float(plain.median())
    rule = DeltaRule.parse(f"weight*weight*act:{threshold}")
    gate = decide_act(rule, GateInputs(ids, w), x, sketch)
    assert gate.mask.all()
    out = torch.zeros(9, 3, HIDDEN)
    moe_slots_ref(x, ids, w, table, pool, fmt, ExpertActivation(), out, delta_mask=gate.mask,
                  delta_table=dtable, delta_fmt=dfmt, act_sketch=gate.sketch,
                  act_coef=gate.coef, act_threshold=gate.threshold)  # fmt: skip
    expected = plain >= threshold
    near = (plain - threshold).abs() <= 1e-5 * threshold  # float ties may go either way
    assert torch.equal(gate.mask[~near], expected[~near])
    assert 0 < int(gate.mask.sum()) < ids.numel()
    # the policy's own reference (the act values given) agrees
    assert torch.equal(decide(rule, GateInputs(ids, w, act=plain / w.pow(2)))[~near],
                       expected[~near])  # fmt: skip
    # the output is the given-mask call's
    ref = torch.zeros(9, 3, HIDDEN)
    moe_slots_ref(x, ids, w, table, pool, fmt, ExpertActivation(), ref, delta_mask=gate.mask,
                  delta_table=dtable, delta_fmt=dfmt)  # fmt: skip
    assert torch.equal(out, ref)


def test_forced_rows_resident_and_other_products():
    fmt, dfmt, pool, table, dtable, sketch = synthetic(seed=2)
    ids, w, x = routing(6, 2, seed=3)
    plain = plain_scores(fmt, pool, ids, w, x, sketch)
    act_values = plain / w.pow(2)
    forced = torch.tensor([False, True, False, False, False, False])
    resident = torch.tensor([True, True, False, True, True, True])
    for text in ("weight*weight*act+weight", "resident:weight*act+forced*weight"):
        middle = (act_values * w).flatten().sort().values[5:7]
        threshold = float(middle.mean())  # between two pairs' scores: no float ties
        rule = DeltaRule.parse(f"{text}:{threshold}")
        inputs = GateInputs(ids, w, forced=forced, resident=resident)
        gate = decide_act(rule, inputs, x, sketch)
        moe_slots_ref(x, ids, w, table, pool, fmt, ExpertActivation(), torch.zeros(6, 2, HIDDEN),
                      delta_mask=gate.mask, delta_table=dtable, delta_fmt=dfmt,
                      act_sketch=gate.sketch, act_coef=gate.coef,
                      act_threshold=gate.threshold)  # fmt: skip
        inputs.act = act_values
        assert torch.equal(gate.mask, decide(rule, inputs))
        assert gate.mask[1].all() or rule.resident  # forced rows take it


triton = pytest.importorskip("triton")


@pytest.mark.parametrize("tokens,act", [(3, "silu"), (2, "gpt_oss")])
def test_triton_matches_ref(tokens, act):
    from moetier.kernels.moe_triton import moe_slots_triton

    bias = act == "gpt_oss"
    fmt, dfmt, pool, table, dtable, sketch = synthetic(seed=4, bias=bias)
    ids, w, x = routing(tokens, 2, seed=5)
    table[3] = -1  # an expert without a slot: its pairs (and mask bytes) untouched
    activation = ExpertActivation(kind=act)
    coef = w.pow(2).contiguous()
    gate_thr = torch.zeros(tokens, 2)
    # a per-pair threshold that splits the pairs: half at 0 (always kept), half at +inf (never)
    gate_thr[::2] = float("inf")
    got_mask = torch.ones(tokens, 2, dtype=torch.bool)
    got = torch.full((tokens, 2, HIDDEN), float("nan"))
    used = moe_slots_triton(x, ids, w, table, pool, fmt, activation, got, delta_mask=got_mask,
                            delta_table=dtable, delta_fmt=dfmt, act_sketch=sketch,
                            act_coef=coef, act_threshold=gate_thr)  # fmt: skip
    ref_mask = torch.ones(tokens, 2, dtype=torch.bool)
    ref = torch.full((tokens, 2, HIDDEN), float("nan"))
    # the twin: int8 activations where the experts' kernel rounded them (the act score never)
    moe_slots_ref(x, ids, w, table, pool, fmt, activation, ref, delta_mask=ref_mask,
                  delta_table=dtable, delta_fmt=dfmt, act_sketch=sketch, act_coef=coef,
                  act_threshold=gate_thr, act_int8=used[0].int8_act)  # fmt: skip
    assert torch.equal(got_mask, ref_mask)
    slotted = table.long()[ids] >= 0
    assert torch.isnan(got[~slotted]).all()
    err = (got[slotted] - ref[slotted]).norm() / ref[slotted].norm()
    assert err < 1e-3, err


@pytest.mark.parametrize("tokens", [3, 130])
def test_triton_scores_match_ref_at_the_median(tokens):
    """Median-score thresholds: the kernel's energies (its own base gate_up, GEMV or grouped
    GEMM from 128 pairs) decide as the ref's on every pair not within float noise of T."""
    from moetier.kernels.blob_decode import matrix_spec
    from moetier.kernels.moe_triton import act_gate

    fmt, dfmt, pool, table, dtable, sketch = synthetic(seed=6)
    ids, w, x = routing(tokens, 1 if tokens > 100 else 2, seed=7)
    plain = plain_scores(fmt, pool, ids, w, x, sketch) / w.pow(2)
    threshold = float(plain.median())
    got = torch.ones(ids.shape, dtype=torch.bool)
    offsets = torch.arange(pool.shape[0], dtype=torch.int64) * pool.stride(0)
    act_gate(x, ids, w, table, pool, offsets, fmt, ExpertActivation(), matrix_spec(fmt, "gate_up"),
             got, sketch, torch.ones(ids.shape), torch.full(ids.shape, threshold))  # fmt: skip
    near = (plain - threshold).abs() <= 1e-4 * threshold
    assert torch.equal(got[~near], (plain >= threshold)[~near])
    assert 0 < int(got.sum()) < ids.numel()


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("act") / "delta"
    convert_quantized(tiny.checkpoint("qwen3_moe"), path, delta="nvfp4", progress=False)
    return path


def test_sketch_command_and_model_runs(store, tiny, capsys):
    from moetier.cli.main import main

    load = lambda d: load_model(  # noqa: E731
        store, EngineConfig(native=False, device="cpu", dtype="float32", delta=d)
    )
    with pytest.raises(ValueError, match="--write-act-sketch"):
        load("weight*act:1")
    assert main(["quality", str(store), "--write-act-sketch", "4"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["rank"] == 4
    sketches = read_sketches(store / "gate_act.safetensors")
    down, gu = sketches[min(sketches)]
    assert down.shape[1] == 4 and gu is None
    ids = torch.randint(1, 320, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        everywhere = load("all").model(ids).logits
        none = load("none").model(ids).logits
        keep_all = load("weight*act:-1")  # every pair clears it
        drop_all = load("weight*act:1e30")
        assert torch.equal(keep_all.model(ids).logits, everywhere)
        assert torch.equal(drop_all.model(ids).logits, none)
        assert keep_all.runtime.delta_pairs == keep_all.runtime.pairs > 0
        assert drop_all.runtime.delta_pairs == 0
        gated = load("weight*weight*act:1e-4")
        gated.model(ids)
    assert 0 <= gated.runtime.delta_pairs <= gated.runtime.pairs


def test_store_without_delta_or_sketches_is_refused(tiny, tmp_path):
    from moetier.quant.store import Store

    plain = Store(tiny.store("qwen3_moe"))
    with pytest.raises(ValueError, match="no delta plane"):
        compute_sketches(plain, 4)
    with pytest.raises(ValueError, match="moetier quality STORE --write-act-sketch"):
        Gate(DeltaRule.parse("weight*act:1"), tmp_path)
