"""bench/kernels.py's `--variant` specs: KernelChoice fields forced on both launches of the
q2s GEMV, with a `gu:` / `dn:` prefix on one, or `gu:...+dn:...` each on its own (the
same-run A/Bs and Nsight Compute targets in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture(scope="module")
def kb():
    sys.path.insert(0, str(BENCH))  # its `common` module
    try:
        spec = importlib.util.spec_from_file_location("bench_kernels", BENCH / "kernels.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_variant_on_both_launches(kb):
    _, fields, launch = kb.parse_variant("depth=2,prefetch_l2=1")
    assert (fields, launch) == ({"depth": 2, "prefetch_l2": True}, "both")
    gu, dn = kb.variant_choices(7168, 2048, 8, fields, launch)
    assert gu.depth == dn.depth == 2 and gu.prefetch_l2 and dn.prefetch_l2


@pytest.mark.parametrize("launch", ["gu", "dn"])
def test_variant_on_one_launch(kb, launch):
    _, fields, got = kb.parse_variant(f"{launch}:split_k=2")
    assert (fields, got) == ({"split_k": 2}, launch)
    gu, dn = kb.variant_choices(7168, 2048, 8, fields, got)
    plain_gu, plain_dn = kb.variant_choices(7168, 2048, 8, {}, "both")
    assert (gu.split_k, dn.split_k) == ((2, 1) if launch == "gu" else (1, 2))
    assert (gu if launch == "dn" else dn) == (plain_gu if launch == "dn" else plain_dn)


def test_variant_with_fields_of_its_own_on_each_launch(kb):
    spec, fields, launch = kb.parse_variant("gu:maxnreg=64+dn:block_n=128,num_warps=8")
    assert launch == "each"
    assert fields == {"gu": {"maxnreg": 64}, "dn": {"block_n": 128, "num_warps": 8}}
    gu, dn = kb.variant_choices(4096, 2048, 6, fields, launch)
    plain_gu, plain_dn = kb.variant_choices(4096, 2048, 6, {}, "both")
    assert gu == replace(plain_gu, maxnreg=64)
    assert dn == replace(plain_dn, block_n=128, num_warps=8)


@pytest.mark.parametrize("bad", ["up:split_k=2", "splitk=2", "depth", "gu:depth=2+gu:pipe=2",
                                 "depth=2+dn:pipe=2"])  # fmt: skip
def test_variant_errors_say_what_is_wrong(kb, bad):
    with pytest.raises(SystemExit, match="--variant"):
        kb.parse_variant(bad)


def test_joint_search_finds_the_pair_one_launch_at_a_time_misses(kb):
    """`joint_search` (`--sweep-joint`): against the probe down, gate_up A looks best, but B
    with down Y is the fastest pair (say Y fits beside B's programs only); it is found, each
    pair runs once, and prefetch_l2 is toggled only on Triton launches (the Gluon kernel has no
    such option)."""
    from moetier.kernels.moe_dispatch import KernelChoice

    a, b, c = (KernelChoice(block_n=n, int8_act=True) for n in (32, 64, 128))
    x, y = KernelChoice(block_n=32, group_acc=True), KernelChoice(block_n=64, gluon=True)
    cost = {(a, x): 5.0, (a, y): 4.0, (b, x): 6.0, (b, y): 2.0, (c, x): 7.0, (c, y): 8.0}
    runs = []

    def run(gu, dn, stage):
        runs.append((gu, dn))
        plain = cost[(replace(gu, prefetch_l2=False), replace(dn, prefetch_l2=False))]
        return plain - (0.5 if dn.prefetch_l2 else 0.0)  # a Triton down's prefetch helps

    (best_gu, best_dn), timed = kb.joint_search([a, b, c], [x, y], [x], run, keep=2, top=3)
    assert (best_gu, best_dn) == (b, y)
    assert len(runs) == len(set(runs)) == len(timed)  # every pair once
    assert (c, y) not in timed  # c was not among the 2 best gate_ups against the probe
    assert (a, replace(x, prefetch_l2=True)) in timed  # (a, x) is third: both toggles
    assert (replace(a, prefetch_l2=True), x) in timed
    assert not any(d.gluon and d.prefetch_l2 for _, d in timed)


def test_config_entries_hold_the_tuned_fields(kb):
    """What --tune, --tune-mma and --sweep-write store for a config: exactly these fields of
    it, each a KernelChoice field (the dispatcher rebuilds the config from them)."""
    c = replace(kb.moe_dispatch.Q2S_GEMV, maxnreg=80, gluon=True)
    entry = kb.config_entry(c, kb.GEMV_FIELDS)
    assert list(entry) == list(kb.GEMV_FIELDS)
    assert replace(kb.moe_dispatch.Q2S_GEMV, **entry) == c
