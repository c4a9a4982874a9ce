"""Speculative decoding with DeepSeek-V4's own MTP layer (models/mtp_deepseek_v4.py).

A tiny deepseek_v4 checkpoint gets an MTP layer in the release's layout (`mtp.0.*`: e_proj,
h_proj, enorm, hnorm, norm, hc_head_{fn,base,scale} and a decoder block named like a main
layer's, its routed experts `ffn.experts.{e}.w1/w2/w3`) and the release's config.json entry
for it (`compress_ratios[num_hidden_layers]`, 0: sliding-window attention, as V4-Flash's), is
converted, and the store's MTP layer drafts: greedy output with 1 and 2 drafts is the output
without them, token for token; the layer's draft logits are DeepSeek's MTPBlock formula
(written here from DeepSeek's inference code) over transformers' own V4 decoder block; a layer
made to predict what the model predicts has its drafts accepted; a prefix hit drafts as if it
computed the prefix (sliding, HCA and CSA MTP layers); what is not supported is refused, saying
so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculative import PREFIX_HITS, fixed_shape_engine, second_request

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.models.attention_batch import AttentionBatch
from moetier.quant.convert import convert

PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42], list(range(60, 75))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
HC_OWN = ("hc_head_fn", "hc_head_base", "hc_head_scale")


def native(store: Path, **config: object):  # type: ignore[no-untyped-def]
    return load_model(store, EngineConfig(native=True, device="cpu", dtype="float32", **config))


def drain(engine: Engine, prompts: list[list[int]] = PROMPTS) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, GREEDY)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


def mtp_tensors(src: Path, ratio: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """An MTP layer for checkpoint `src` named as the release names it: the last decoder
    layer's tensors, perturbed, under `mtp.0.` (its compressor left out where `ratio` is 0),
    and the layer's own tensors."""
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    hidden = config["hidden_size"]
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    gen = torch.Generator().manual_seed(seed)

    def near(t: torch.Tensor) -> torch.Tensor:
        return t + torch.randn(t.shape, generator=gen) * 0.05

    mtp = {}
    for key, t in tensors.items():
        rest = key.removeprefix(last)
        if key == rest or not t.is_floating_point():
            continue
        if ratio == 0 and rest.startswith("attn.compressor."):
            continue
        mtp["mtp.0." + rest] = near(t)
    for name in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{name}.weight"] = torch.randn(hidden, hidden, generator=gen) * 0.15
    for name in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{name}.weight"] = near(torch.ones(hidden))
    for name in HC_OWN:
        mtp[f"mtp.0.{name}"] = near(tensors[name.replace("hc_head_", "model.hc_head.hc_")])
    return mtp


def write_checkpoint(src: Path, dst: Path, mtp: dict[str, torch.Tensor], ratio: int | None) -> Path:
    """`src` with the MTP tensors added and config.json's compress_ratios as the release
    writes it (one entry a decoder layer, then the MTP layer's `ratio`; None: no MTP entry)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, **mtp}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    rates = {"sliding_attention": 0, "compressed_sparse_attention": 4,
             "heavily_compressed_attention": 128}  # fmt: skip
    ratios = [rates[kind] for kind in config["layer_types"]]
    config["compress_ratios"] = ratios if ratio is None else [*ratios, ratio]
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def v4(tiny, tmp_path_factory):  # type: ignore[no-untyped-def]
    """(checkpoint, store) with a random MTP layer of sliding-window attention."""
    from tiny_models import skip_without_transformers_family

    skip_without_transformers_family("deepseek_v4")
    root = tmp_path_factory.mktemp("v4-mtp")
    src = tiny.checkpoint("deepseek_v4")
    hf = write_checkpoint(src, root / "hf", mtp_tensors(src, 0), 0)
    return hf, convert(hf, root / "store", progress=False)


@pytest.fixture(scope="module")
def want(v4):  # type: ignore[no-untyped-def]
    """The greedy text of the model without drafts."""
    return drain(Engine(native(v4[1]), EngineLimits(num_pages=64, page_size=4)))


def speculative(store: Path, k: int, fixed: bool = False) -> Engine:
    limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=k,
                          speculative_policy="always")  # fmt: skip
    engine = Engine(native(store, mtp=True), limits)
    engine.runner.fixed_shapes = fixed  # verify steps as the CUDA graphs' decode rows
    return engine


@pytest.mark.parametrize("k, fixed", [(1, False), (2, False), (2, True)])
def test_greedy_output_is_unchanged_with_the_mtp_layers_drafts(v4, want, k, fixed):
    """The store's MTP layer (its routed experts in the runtime, its KV in the cache's layer
    num_hidden_layers) drafts k tokens a step: the text without drafts, token for token, on
    the packed path and on fixed-shape decode rows."""
    _, store = v4
    engine = speculative(store, k, fixed)
    layer = engine.runner.model.config.num_layers
    assert layer in engine.runner.loaded.runtime.formats  # the MTP experts joined the runtime
    assert engine.runner.cache.shape[0] == layer + 1
    assert drain(engine) == want
    stats = engine.runner.drafter.stats
    assert stats.steps > 0 and len(stats.drafted) == k
    if fixed:
        assert engine.runner.verify_graphed > 0


def test_drafting_on_fixed_shapes_gives_the_eager_drafts(v4, want):
    """The drafting on the draft graphs' fixed-shape inputs (engine/draft_graphs.py; the
    kept hidden states are V4's streams, hc x H wide) proposes the eager drafting's drafts,
    call for call."""
    runs = []
    for fixed_drafting in (True, False):
        engine = speculative(v4[1], 2, fixed=True)
        drafter = engine.runner.drafter
        if not fixed_drafting:
            drafter.layout = None
        real, seen = drafter.draft, []

        def recording(requests, k, cache, real=real, seen=seen):  # type: ignore[no-untyped-def]
            real(requests, k, cache)
            seen.extend((r.id, len(r.output), tuple(r.drafts)) for r in requests)

        drafter.draft = recording
        assert drain(engine) == want
        assert (drafter.graphed > 0) == fixed_drafting
        runs.append(seen)
    assert runs[0] == runs[1] and len(runs[0]) > 3


@pytest.mark.parametrize("ratio", [0, 128])
def test_draft_logits_are_deepseeks_mtp_formula(tiny, tmp_path, ratio):
    """The MTP layer's logits at every position of a prompt, against DeepSeek's MTPBlock
    formula written here (inference/model.py: e_proj(enorm(embed(t_{p+1}))) broadcast to the
    streams + h_proj(hnorm(streams_p)), the block, then head(norm(hc_head(.))) with the
    layer's own hc_head and norm) over transformers' own DeepseekV4 decoder block and the
    main model's streams before its hc_head, from transformers' forward."""
    from tiny_models import skip_without_transformers_family
    from transformers import AutoModelForCausalLM

    skip_without_transformers_family("deepseek_v4")
    src = tiny.checkpoint("deepseek_v4")
    mtp = mtp_tensors(src, ratio)
    hf = write_checkpoint(src, tmp_path / "hf", mtp, ratio)
    store = convert(hf, tmp_path / "store", progress=False)
    tokens = torch.tensor([PROMPTS[2]])
    length = tokens.shape[1]

    # transformers: the main model's streams after its last layer, before hc_head
    main = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    seen = {}
    main.model.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("s", out))
    # the block: a one-layer transformers model holding the MTP layer's block, its hc_head
    # and norm the MTP layer's own, embedding and head the main model's
    config = json.loads((hf / "config.json").read_text())
    kind = {0: "sliding_attention", 128: "heavily_compressed_attention"}[ratio]
    config.update(num_hidden_layers=1, layer_types=[kind], mlp_layer_types=["moe"])
    config.pop("compress_ratios")
    one = tmp_path / "one"
    one.mkdir()
    (one / "config.json").write_text(json.dumps(config))
    weights = load_file(str(src / "model.safetensors"))
    own = (*HC_OWN, *(f"{n}.weight" for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm")))
    block = {
        k.replace("mtp.0.", "model.layers.0."): v
        for k, v in mtp.items()
        if k.removeprefix("mtp.0.") not in own
    }
    for name in HC_OWN:
        block[name.replace("hc_head_", "model.hc_head.hc_")] = mtp[f"mtp.0.{name}"]
    block["model.norm.weight"] = mtp["mtp.0.norm.weight"]
    block["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    block["head.weight"] = weights["head.weight"]
    save_file(block, str(one / "model.safetensors"), metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(
        one, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    eps = config["rms_norm_eps"]

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        main(tokens)
        streams = seen["s"]  # [1, T, hc, H]
        embeds = main.model.embed_tokens(tokens[:, 1:])
        x = (rms(embeds, mtp["mtp.0.enorm.weight"]) @ mtp["mtp.0.e_proj.weight"].T)[:, :, None]
        x = x + rms(streams[:, :-1], mtp["mtp.0.hnorm.weight"]) @ mtp["mtp.0.h_proj.weight"].T
        ref.model.layers[0].register_forward_pre_hook(lambda m, args: (x, *args[1:]))
        want = ref(tokens[:, 1:]).logits[0]  # [T - 1, V]

        model = native(store, mtp=True).model
        cache = model.new_cache(8, 4, torch.float32, "cpu")
        pages = list(range(4))
        batch = AttentionBatch.packed([(0, length, pages)], 4, "cpu")
        hidden = model.model(tokens, batch.positions, cache, batch)  # [1, T, hc H]
        assert (hidden.unflatten(-1, streams.shape[-2:]) - streams).abs().max() <= 1e-4
        batch = AttentionBatch.packed([(0, length - 1, pages)], 4, "cpu")
        out = model.mtp.step(model.model, tokens[:, 1:], hidden[:, :-1], batch, cache)
        got = model.mtp.logits(out, model.lm_head)[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert want.std() > 0.1  # (not a degenerate comparison)


def test_an_mtp_layer_that_predicts_the_model_has_its_drafts_accepted(v4, want, tiny, tmp_path):
    """An MTP layer made to predict what the model predicts after each token of its greedy
    text (block and h_proj silenced: every stream is e_proj(enorm(embed(t))), solved so that
    the shared head reads the model's next token after t from it), drafting through the
    engine's real path with 2 drafts: the same text, and most drafts accepted."""
    hf, _ = v4
    weights = load_file(str(hf / "model.safetensors"))
    mtp = {k: v for k, v in weights.items() if k.startswith("mtp.0.")}
    nxt: dict[int, int] = {}  # token -> the model's greedy token after it
    for i, prompt in enumerate(PROMPTS):
        seq = prompt + want[f"r{i}"]
        for a, b in zip(seq[len(prompt) - 1 :], seq[len(prompt) :], strict=False):
            nxt.setdefault(a, b)
    tokens = torch.tensor(sorted(nxt))
    embeds = weights["model.embed_tokens.weight"][tokens]
    eps = json.loads((hf / "config.json").read_text())["rms_norm_eps"]
    a = embeds * torch.rsqrt(embeds.pow(2).mean(-1, keepdim=True) + eps)  # enorm, weight 1
    b = weights["head.weight"][torch.tensor([nxt[t] for t in sorted(nxt)])]
    assert len(nxt) < a.shape[1]  # an exact solution: e_proj a_t = b_t for every t
    mtp["mtp.0.e_proj.weight"] = torch.linalg.lstsq(a, b).solution.T.contiguous()
    mtp["mtp.0.h_proj.weight"] = torch.zeros_like(mtp["mtp.0.h_proj.weight"])
    for name in ("enorm", "norm"):
        mtp[f"mtp.0.{name}.weight"] = torch.ones_like(mtp[f"mtp.0.{name}.weight"])
    for key in mtp:  # the block adds nothing to the streams
        if key.endswith(("attn.wo_b.weight", "w2.weight")):
            mtp[key] = torch.zeros_like(mtp[key])
    src = tiny.checkpoint("deepseek_v4")  # the main model without the MTP layer
    store = convert(write_checkpoint(src, tmp_path / "hf", mtp, 0), tmp_path / "s", progress=False)
    engine = speculative(store, 2)
    assert drain(engine) == want
    stats = engine.runner.drafter.stats
    assert stats.acceptance > 0.5 and stats.accepted[1] > 0  # chained drafts right too


def test_what_is_not_supported_is_refused(v4, tiny, tmp_path):
    """No MTP entry in compress_ratios (its attention type unknown), a config naming another
    attention type than the stored block's, --mtp-file, a store without the layer."""
    _, store = v4
    edited = tmp_path / "edited"
    shutil.copytree(store, edited)
    config = json.loads((edited / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["compress_ratios"] = config["compress_ratios"][:layers]
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not say which attention DeepSeek-V4's MTP layer"):
        native(edited, mtp=True)
    config["compress_ratios"] = [*config["compress_ratios"], 128]  # HCA: a compressor
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match the model's heavily_compressed"):
        native(edited, mtp=True)
    with pytest.raises(ValueError, match="--mtp-file is not supported for deepseek_v4"):
        native(store, mtp_file=str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ValueError, match="has no DeepSeek-V4 MTP layer"):
        native(tiny.store("deepseek_v4"), mtp=True)


# main models with every layer type and windows short enough that the prompts below close
# entries (HCA every 8 positions, CSA every 4 with its indexer), their last layer (whose tensors
# the MTP layer copies) of the MTP layer's type; 8 indexer heads make ties of its scores unlikely
COMPRESSED_MTP = {
    "hca": (["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            128),
    "csa": (["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
            4),
}  # fmt: skip


@pytest.fixture(scope="module")
def mtp_stores(v4, tmp_path_factory):  # type: ignore[no-untyped-def]
    """MTP layer kind -> a store whose MTP layer attends so: sliding (v4's), and heavily
    compressed / compressed sparse (its cache rows holding its compressor's raw rows and
    entries, CSA's indexer's too) over a main model of every layer type."""
    from tiny_models import build_tiny

    stores = {"sliding": v4[1]}
    for kind, (layer_types, ratio) in COMPRESSED_MTP.items():
        root = tmp_path_factory.mktemp(f"v4-mtp-{kind}")
        src = build_tiny("deepseek_v4", root / "src", layer_types=layer_types, index_n_heads=8,
                         compress_rates={"compressed_sparse_attention": 4,
                                         "heavily_compressed_attention": 8})  # fmt: skip
        hf = write_checkpoint(src, root / "hf", mtp_tensors(src, ratio), ratio)
        stores[kind] = convert(hf, root / "store", progress=False)
    return stores


@pytest.mark.parametrize("case", list(PREFIX_HITS))
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_prefix_hit_drafts_as_if_it_computed_the_prefix(case, kind, fixed, mtp_stores):
    """test_speculative.py's prefix-hit comparison for DeepSeek-V4's MTP layer (sliding-window
    attention as the release's; heavily compressed and compressed sparse, whose cache rows at
    a position also hold compressor (and indexer) rows pooled over earlier positions of its
    window), eagerly and on fixed shapes: a request taking pages from the prefix cache finds
    there, at its first draft, the MTP layer's cache rows it would have written itself with the
    prefix cache off, and drafts the same tokens call for call; the same text. Cases: a shared
    prefix ending on a page boundary (another token after it), inside a page, the next turn of
    a conversation, a first request that never drafted."""
    store = mtp_stores[kind]
    first, first_params, second, hit = PREFIX_HITS[case]
    first_params = SamplingParams(temperature=0.0, **first_params)
    runs = []
    for caching in (True, False):
        if fixed:
            engine = fixed_shape_engine(native(store, mtp=True), 64, drafts=2,
                                        prefix_caching=caching)  # fmt: skip
        else:
            limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=2,
                                  speculative_policy="always", prefix_caching=caching)  # fmt: skip
            engine = Engine(native(store, mtp=True), limits)
        runs.append(second_request(engine, first, first_params, second))
        if fixed:
            assert engine.runner.drafter.graphed > 0
    (out, drafts, kv, cached), (out_off, drafts_off, kv_off, cached_off) = runs
    assert out == out_off
    assert len(kv) == len(kv_off) > hit
    stale = [p for p, (a, b) in enumerate(zip(kv, kv_off, strict=True))
             if not torch.allclose(a, b, atol=1e-5)]  # fmt: skip
    assert stale == []
    assert drafts == drafts_off and len(drafts) > 3
    assert (cached, cached_off) == (hit, 0)
