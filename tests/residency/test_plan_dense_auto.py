"""`--dense auto` (residency/dense_choice.py) and the planner's dense bytes per `--dense` format:
a plan from a config equals `plan` of the store written at that config and format; the real
shapes' dense bytes against hand counts from the published architectures; the choice is the
first of bf16 > fp8 > int4 > nvfp4 whose cache holds one token's experts; refusals name what
would fit; `convert --dense auto` writes what the planner chose; docs/residency.md's table is
the command's output."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from tiny_models import skip_without_transformers_family

from moetier.cli.main import main
from moetier.cli.plan import DENSE_TABLE_CASES, dense_table
from moetier.quant.dense_formats import AUTO_ORDER, DensePolicy
from moetier.quant.store import Store
from moetier.quant.synthetic import meta_model, shape, write_synthetic_store
from moetier.residency import dense_choice
from moetier.residency.planner import parse_bytes, plan, plan_shape

DOCS = Path(__file__).resolve().parents[2] / "docs"


def config_or_skip(name: str) -> dict:
    config = shape(name)
    skip_without_transformers_family(config["model_type"])
    meta_model(config)
    return config


@pytest.mark.parametrize("fmt", ["fp8", "int4-g16", "nvfp4", "bf16"])
@pytest.mark.parametrize("name", ["tiny", "glm-5-tiny"])
def test_plan_from_config_with_dense_format_equals_plan_of_its_store(tmp_path, name, fmt):
    """The bytes a synthetic store really holds for each --dense format (scales included)."""
    config = config_or_skip(name)
    policy = DensePolicy.parse(fmt, ["lm_head=fp8"] if fmt != "bf16" else [])
    store = Store(write_synthetic_store(tmp_path / name, config, "q2s", distinct=2, dense=policy))
    if fmt != "bf16":
        assert store.dense_formats  # something was quantized
    for gpu, host in (("1GiB", "0"), ("600MiB", "2MiB")):
        budgets = dict(gpu_memory=parse_bytes(gpu), host_memory=parse_bytes(host),
                       max_context=256, zero_copy_stage=1)  # fmt: skip
        ours = plan_shape(config, dense=policy, **budgets)
        assert dataclasses.asdict(ours) == dataclasses.asdict(plan(store, **budgets))


def qwen3_dense_bytes(c: dict, kind: str) -> int:
    """Qwen3-MoE's dense bytes by hand: per layer q [H·heads, H], k and v [d·kv, H], o, q/k
    norms [d], two layer norms [H], the router [E, H]; embeddings and lm_head [V, H]. Attention
    and lm_head in `kind` (fp8: a byte a weight + a float32 per row and 128 columns; int4-g128:
    half a byte + a bf16 scale per 128 along K), the rest bf16."""
    h, d, v, e = c["hidden_size"], c["head_dim"], c["vocab_size"], c["num_experts"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    mats = [(q, h), (kv, h), (kv, h), (h, q)] * c["num_hidden_layers"] + [(v, h)]  # + lm_head

    def size(n: int, k: int) -> int:
        if kind == "fp8":  # a float32 scale per row and 128 columns
            return n * k + 4 * n * math.ceil(k / 128)
        if kind == "int4":
            return n * k // 2 + 2 * n * k // 128
        return 2 * n * k

    plain = v * h + c["num_hidden_layers"] * (2 * d + 2 * h + e * h) + h  # + final norm
    return sum(size(n, k) for n, k in mats) + 2 * plain


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int4"])
def test_qwen3_235b_dense_bytes_by_hand(kind):
    config = config_or_skip("qwen3-235b-a22b")
    p = plan_shape(config, parse_bytes("80GiB"), dense=DensePolicy.parse(kind))
    assert p.dense_bytes == qwen3_dense_bytes(config, kind)
    assert p.base_blobs == 94 * 128 and p.blobs_per_token == 94 * 8
    assert p.kv_bytes == 94 * 2 * 4 * 128 * 4096 * 2  # GQA: 4 KV heads of 128, K and V


def deepseek_v3_dense_params(c: dict) -> int:
    """DeepSeek-V3's non-expert parameters from its architecture: MLA (q LoRA with its norm, kv
    LoRA + rope key with its norm, up projections, output), two norms a layer, the first
    `first_k_dense_replace` layers' dense MLP, then per MoE layer the router [E, H], its
    correction bias [E] and one shared expert; embeddings, lm_head and the final norm."""
    h, heads, v = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    qr, kvr, nope, rope, vd = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                             "qk_rope_head_dim", "v_head_dim"))  # fmt: skip
    attention = (h * qr + qr + qr * heads * (nope + rope) + h * (kvr + rope) + kvr
                 + kvr * heads * (nope + vd) + heads * vd * h)  # fmt: skip
    layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    e = c["n_routed_experts"]
    moe = e * h + e + 3 * h * c["moe_intermediate_size"] * c["n_shared_experts"]
    return (2 * v * h + h + layers * (attention + 2 * h) + dense * 3 * h * c["intermediate_size"]
            + (layers - dense) * moe)  # fmt: skip


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_deepseek_v3_and_kimi_k2_dense_by_hand(name):
    config = config_or_skip(name)
    p = plan_shape(config, parse_bytes("80GiB"))
    assert p.dense_bytes == 2 * deepseek_v3_dense_params(config)
    moe_layers = 61 - config["first_k_dense_replace"]
    assert p.base_blobs == moe_layers * config["n_routed_experts"]
    assert p.blobs_per_token == moe_layers * 8
    assert p.kv_bytes == 61 * (512 + 64) * 4096 * 2
    if name == "deepseek-v3":  # the "about 17 B non-expert parameters, 34 GB in bf16"
        assert 16.5e9 < deepseek_v3_dense_params(config) < 17.5e9


def cached(p) -> int:  # type: ignore[no-untyped-def]
    """GPU base slots minus the staging slots (recomputed here, not dense_choice's)."""
    return p.gpu_base_slots - p.staging


@pytest.mark.parametrize("case", DENSE_TABLE_CASES, ids=[c[0] for c in DENSE_TABLE_CASES])
def test_auto_picks_the_largest_precision_with_one_tokens_experts_cached(case):
    name, gpu, host = case
    config = config_or_skip(name)
    budgets = dict(gpu_memory=parse_bytes(gpu), host_memory=parse_bytes(host), zero_copy_stage=3)
    choice = dense_choice.choose_dense(config, **budgets)
    assert choice.kind in AUTO_ORDER
    for kind in AUTO_ORDER:  # each planned directly, without dense_choice
        try:
            p = plan_shape(config, dense=DensePolicy.parse(kind), **budgets)
        except ValueError:
            assert AUTO_ORDER.index(kind) < AUTO_ORDER.index(choice.kind)
            continue
        ok = cached(p) >= p.blobs_per_token
        if kind == choice.kind:
            assert ok and p == choice.plan
            break
        assert not ok, f"{kind} leaves {cached(p)} slots, enough: auto should have taken it"


def test_refusals_name_the_option_that_fits(capsys):
    config = config_or_skip("deepseek-v3")
    budgets = dict(host_memory=parse_bytes("512GiB"), zero_copy_stage=3)
    with pytest.raises(ValueError, match="--dense int4 with --embeddings host fits") as err:
        dense_choice.choose_dense(config, parse_bytes("16GiB"), **budgets)
    # and it does: planned directly, the option keeps one token's experts
    p = plan_shape(config, parse_bytes("16GiB"), dense=DensePolicy.parse("int4"),
                   embeddings_host=True, **budgets)  # fmt: skip
    assert cached(p) >= p.blobs_per_token
    assert f"{cached(p)} expert slots (one token reads {p.blobs_per_token})" in str(err.value)
    # too small for anything: the least --gpu-memory that would do, which does
    with pytest.raises(ValueError, match="needs --gpu-memory") as err:
        dense_choice.choose_dense(config, parse_bytes("12GiB"), **budgets)
    text = str(err.value)
    need = parse_bytes(text.split("needs --gpu-memory ")[1].split(" ")[0])  # 'NMiB (x GiB)'
    kind = text.split("The least that would do, --dense ")[1].split(" ")[0]
    for gpu, ok in ((need, True), (need - 2**20, False)):  # the least, to the MiB
        p = plan_shape(config, gpu, dense=DensePolicy.parse(kind),
                       embeddings_host=True, **budgets)  # fmt: skip
        assert (cached(p) >= p.blobs_per_token) is ok
    # an explicit format whose dense part does not fit names the one that would
    args = ["plan", "--shape", "deepseek-v3", "--gpu-memory", "24GiB", "--host-memory", "512GiB"]
    assert main([*args, "--dense", "bf16"]) != 0
    err_text = capsys.readouterr().err
    assert "more than --gpu-memory" in err_text and "--dense int4 fits: dense" in err_text
    assert main([*args, "--dense", "auto"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("--dense auto chose ")


def test_the_gpu_memory_a_refusal_asks_for_is_exact(eval_model):
    """eval-moe-70m at 530MiB: the message gave the budget back as '0.52 GiB' and asked for
    '0.52 GiB or more' (the need, some MiB more, rounded to 2 decimals), which is no more. It
    names the budget as given and the least that does, in MiB: that works, 1 MiB less not."""
    config = json.loads((eval_model / "config.json").read_text())
    budgets = dict(host_memory=0, max_context=4096, zero_copy_stage=3)
    with pytest.raises(ValueError, match="needs --gpu-memory") as err:
        dense_choice.choose_dense(config, parse_bytes("530MiB"), **budgets)
    text = str(err.value)
    assert "on --gpu-memory 530MiB (" in text and "GiB or more" not in text
    need = text.split("needs --gpu-memory ")[1].split(" ")[0]
    kind = text.split("The least that would do, --dense ")[1].split(",")[0]
    assert need.endswith("MiB") and parse_bytes(need) > parse_bytes("530MiB")
    assert dense_choice.choose_dense(config, parse_bytes(need), **budgets).kind == kind
    with pytest.raises(ValueError, match=f"needs --gpu-memory {need} or more"):
        dense_choice.choose_dense(config, parse_bytes(need) - 2**20, **budgets)


def test_size_flags_read_back_as_enough_or_no_more():
    from moetier.residency.planner import size_flag

    assert size_flag(parse_bytes("24GiB")) == "24GiB"
    assert size_flag(parse_bytes("530MiB"), up=False) == "530MiB"
    for text in ("0.52GiB", "24GB", "530MB", "23.47GiB"):
        n = parse_bytes(text)
        assert (
            parse_bytes(size_flag(n).split(" ")[0]) - 2**20
            < n
            <= parse_bytes(size_flag(n).split(" ")[0])
        )
        assert parse_bytes(size_flag(n, up=False).split(" ")[0]) <= n
    assert size_flag(parse_bytes("23.47GiB")) == "24034MiB (23.47 GiB)"


def test_plan_refuses_dense_for_a_store(tmp_path, capsys):
    store = write_synthetic_store(tmp_path / "s", shape("tiny"), "q2s", distinct=2)
    assert main(["plan", str(store), "--gpu-memory", "1GiB", "--dense", "fp8"]) != 0
    assert "--dense applies with --shape" in capsys.readouterr().err


def test_convert_dense_auto_writes_the_chosen_precision(tiny, tmp_path, capsys):
    """A budget where bf16 leaves one slot too few and fp8 exactly enough: convert --dense auto
    writes fp8, and the store's own plan at that budget keeps one token's experts."""
    src = tiny.checkpoint("qwen3_moe")
    config = json.loads((src / "config.json").read_text())
    fmt = dense_choice.convert_expert_format(config, "source")
    fp8 = plan_shape(config, parse_bytes("1GiB"), experts=fmt, dense=DensePolicy.parse("fp8"))
    budget = (fp8.dense_bytes + fp8.kv_bytes + fp8.workspace_bytes
              + fp8.blobs_per_token * fp8.slot_bytes)  # fmt: skip
    bf16 = plan_shape(config, budget, experts=fmt, dense=DensePolicy.parse("bf16"))
    assert cached(bf16) < bf16.blobs_per_token  # the fp8 bytes saved exceed one slot
    out_dir = tmp_path / "store"
    assert main(["convert", str(src), str(out_dir), "--dense", "auto", "--gpu-memory",
                 str(budget)]) == 0  # fmt: skip
    assert "--dense auto chose fp8" in capsys.readouterr().out
    store = Store(out_dir)
    assert {f.kind for f in store.dense_formats.values()} == {"fp8"}
    ours = plan(store, budget)
    assert cached(ours) == ours.blobs_per_token
    predicted = plan_shape(config, budget, experts=fmt, dense=DensePolicy.parse("fp8"))
    assert dataclasses.asdict(ours) == dataclasses.asdict(predicted)
    # auto needs the card's size
    assert main(["convert", str(src), str(tmp_path / "x"), "--dense", "auto"]) != 0
    assert "--dense auto needs --gpu-memory" in capsys.readouterr().err


@pytest.mark.parametrize("dense", ["bf16", "fp8"])
def test_tied_embeddings_are_planned_once_as_the_store_keeps_them(tmp_path, dense):
    """A checkpoint whose output head is its embedding table (tie_word_embeddings, as
    eval-moe-70m): the plan from its config counted the table twice, as embedding and lm_head
    (eval-moe-70m: dense 22 MiB, its store's 14 MiB); the store keeps it once."""
    from tiny_models import build_tiny

    from moetier.quant.convert import convert

    src = build_tiny("qwen3_moe", tmp_path / "tied", tie_word_embeddings=True)
    config = json.loads((src / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    store = Store(convert(src, tmp_path / "store", progress=False,
                          dense=DensePolicy.parse(dense)))  # fmt: skip
    assert "lm_head.weight" not in store.index["dense"]["tensors"]
    fmt = dense_choice.convert_expert_format(config, "source")
    budget = parse_bytes("1GiB")
    predicted = plan_shape(config, budget, experts=fmt, dense=DensePolicy.parse(dense))
    assert dataclasses.asdict(plan(store, budget)) == dataclasses.asdict(predicted)


def test_docs_table_is_the_commands_output():
    for name, _, _ in DENSE_TABLE_CASES:
        config_or_skip(name)
    table = dense_table()
    doc = (DOCS / "residency.md").read_text()
    assert "moetier plan --dense-table" in doc
    assert table in doc, "docs/residency.md's --dense auto table is stale: paste the output"
    for line in table.splitlines()[2:]:  # each model fits with what it chose
        assert "**" in line
