"""`moetier quality` with the gate: the sensitivity and hot-set tables it writes, and gated runs'
delta rate and bits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moetier.cli.main import main
from moetier.gate.tables import hot_set, read_table, write_table
from moetier.loader.quantize import convert_quantized
from moetier.quant.store import Store

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers"


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("gate_quality")
    src = tiny.checkpoint("qwen3_moe")
    store = root / "delta"
    convert_quantized(src, store, delta="nvfp4", progress=False)
    text = root / "text.txt"
    rng = np.random.default_rng(0)
    text.write_text(" ".join(rng.choice(WORDS.split(), 3000)))
    return src, store, text


def quality(capsys, src, store, text, *extra):
    args = ["quality", str(store), "--reference", str(src), "--text", str(text)]
    assert main([*args, "--ctx", "64", "--chunks", "4", "--device", "cpu", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_sensitivity_table_matches_per_layer_runs(setup, capsys, tmp_path):
    src, store, text = setup
    out = tmp_path / "sens.json"
    line = quality(capsys, src, store, text, "--write-sensitivity", "--table-out", str(out))
    table = read_table(out)
    layers = sorted(table)
    assert layers == sorted(int(k) for k in line["removed_by_layer"])
    values = torch.cat([table[layer] for layer in layers])
    assert (values >= 0).all() and values.mean().item() == pytest.approx(1.0)
    # the KLD the delta on one layer removes, checked through the ordinary gate path: a table
    # with 1 on that layer's experts, rule sensitivity:0.5
    base = quality(capsys, src, store, text, "--delta", "none")
    assert base["mean_kld"] == pytest.approx(line["base_kld"], abs=1e-6)
    layer = layers[0]
    one = tmp_path / "one.json"
    write_table(one, "sensitivity", {x: [float(x == layer)] * 8 for x in layers}, "test")
    only = quality(capsys, src, store, text, "--delta", f"sensitivity@{one}:0.5")
    removed = base["mean_kld"] - only["mean_kld"]
    assert line["removed_by_layer"][str(layer)] == pytest.approx(removed, abs=1e-6)
    assert 0 < only["delta_rate"] < 1


def test_hot_table_from_a_trace(setup, capsys, tmp_path):
    src, store, text = setup
    ids = np.random.default_rng(1).integers(0, 8, size=(2, 500, 2)).astype("uint8")
    np.savez(tmp_path / "trace.npz", expert_ids=ids)
    out = tmp_path / "hot.json"
    quality(capsys, src, store, text, "--write-hot", "0.4", "--trace", str(tmp_path / "trace.npz"),
            "--table-out", str(out))  # fmt: skip
    table = read_table(out)
    want = hot_set(torch.from_numpy(ids.astype("int64")), 8, 0.4)
    layers = sorted(table)
    assert [table[layer].tolist() for layer in layers] == [want[0], want[1]]


def test_gated_run_reports_rate_and_bits(setup, capsys):
    src, store, text = setup
    line = quality(capsys, src, store, text, "--delta", "budget:0.25:weight+confidence")
    assert line["delta_rate"] == pytest.approx(0.25, abs=0.01)
    bits = Store(store).plane_bits_per_weight("delta")  # NVFP4 with the tiny shape's scales
    assert 4.5 <= bits < 5.5
    got = line["delta_bits_per_active_weight"]
    assert got == pytest.approx(line["delta_rate"] * bits, rel=1e-3)
    none = quality(capsys, src, store, text, "--delta", "none")
    assert none["delta_rate"] == 0 and none["mean_kld"] > line["mean_kld"]
