"""bench/kernels.py's `--variant` specs: KernelChoice fields forced on both launches of the
q2s GEMV, or with a `gu:` / `dn:` prefix on one (the same-run A/Bs and Nsight Compute
targets in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
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


@pytest.mark.parametrize("bad", ["up:split_k=2", "splitk=2", "depth"])
def test_variant_errors_say_what_is_wrong(kb, bad):
    with pytest.raises(SystemExit, match="--variant"):
        kb.parse_variant(bad)
