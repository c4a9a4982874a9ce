from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TEXT

from moetier.engine.quality import chunks, compare

VOCAB = 50


def table_model(seed: int, noise: float = 0.0):
    """A fake 'model': logits depend on the token at each position (a bigram table)."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    noisy = table + noise * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(99))
    return (lambda ids: table[ids]), (lambda ids: noisy[ids]), table, noisy


def test_identical_models_have_zero_divergence():
    ref, _, _, _ = table_model(0)
    ids = chunks(torch.randint(0, VOCAB, (1000,)).tolist(), ctx=64)
    report = compare(ref, ref, ids)
    assert report.chunks == 15 and report.scored_tokens == 15 * 32  # second half of each chunk
    assert report.mean_kld == 0 and report.same_top1 == 1 and report.ppl_ratio == 1


def test_matches_an_independent_computation():
    ref, noisy, table, noisy_table = table_model(1, noise=0.5)
    ids = chunks(
        torch.randint(0, VOCAB, (640,), generator=torch.Generator().manual_seed(3)).tolist(), 64
    )
    report = compare(noisy, ref, ids, batch_size=3)
    # Independent: F.kl_div over the scored positions only (predictions at 31..62 of each chunk).
    pos = ids[:, 31:63]
    target = ids[:, 32:64]
    logq = F.log_softmax(noisy_table[pos].double(), -1)
    logp = F.log_softmax(table[pos].double(), -1)
    kld = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1).flatten()
    assert math.isclose(report.mean_kld, kld.mean().item(), rel_tol=1e-9)
    assert math.isclose(report.p99_kld, torch.quantile(kld, 0.99).item(), rel_tol=1e-9)
    nll = -logq.gather(-1, target.unsqueeze(-1)).mean().item()
    assert math.isclose(report.ppl, math.exp(nll), rel_tol=1e-9)
    same = (logq.argmax(-1) == logp.argmax(-1)).double().mean().item()
    assert report.same_top1 == same < 1


def test_quality_cli_on_a_store(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 20)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moetier",
            "quality",
            str(tiny.store("qwen3_moe")),
            "--reference",
            str(tiny.checkpoint("qwen3_moe")),
            "--text",
            str(text),
            "--ctx",
            "64",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["scored_tokens"] == line["chunks"] * 32 and line["chunks"] >= 4
    assert line["mean_kld"] < 1e-9 and line["same_top1"] == 1.0  # fp32 store == fp32 reference
    assert line["experts_bpw"] == 32.0  # the tiny checkpoint is fp32
    # stderr is a pipe: no progress bars, transformers' "Loading weights" of the reference
    # included (docs/operations.md)
    assert "Loading weights" not in out.stderr and "it/s]" not in out.stderr


def quality(capsys, store, reference, *flags):
    """`moetier quality` in this process on this file's text: (exit status, stdout, stderr)."""
    from moetier.cli.main import main

    rc = main(["quality", str(store), "--reference", str(reference), "--text", __file__,
               "--device", "cpu", *flags])  # fmt: skip
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_a_reference_of_another_model_is_refused_naming_what_differs(tiny, tmp_path, capsys):
    from tiny_models import build_tiny

    store, checkpoint = tiny.store("qwen3_moe"), tiny.checkpoint("qwen3_moe")
    wider = build_tiny("qwen3_moe", tmp_path / "wider", vocab_size=400)  # the same tokenizer
    rc, _, err = quality(capsys, store, wider)
    assert rc == 1 and "Traceback" not in err
    assert "vocab_size 320 in the store, 400 in the reference" in err
    # the other way round: a store of the wider model against the 320-token checkpoint
    from moetier.quant.convert import convert

    wide_store = convert(wider, tmp_path / "wider-store", progress=False)
    rc, _, err = quality(capsys, wide_store, checkpoint)
    assert rc == 1 and "vocab_size 400 in the store, 320 in the reference" in err
    rc, _, err = quality(capsys, store, tiny.checkpoint("mixtral"))
    assert rc == 1 and "model_type qwen3_moe in the store, mixtral in the reference" in err
    rc, _, err = quality(capsys, store, tmp_path)
    assert rc == 1 and "no config.json there" in err
    # the same config with another tokenizer: two tokens' ids swapped
    other = tmp_path / "other-tokenizer"
    shutil.copytree(checkpoint, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[200:202]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    rc, _, err = quality(capsys, store, other)
    assert rc == 1 and "its tokenizer is not the store's (2 of the store's 320 tokens" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ctx", "1"], "--ctx 1: a chunk needs 2 tokens or more"),
        (["--ctx", "0"], "--ctx 0: a chunk needs 2 tokens or more"),
        (["--chunks", "-1"], "--chunks -1: give 0 (every chunk)"),
        (["--batch-size", "0"], "--batch-size 0: give 1 or more"),
        (["--native"], "quality does not take --native"),
    ],
)
def test_flags_quality_cannot_take_are_refused(tiny, capsys, flags, message):
    rc, _, err = quality(capsys, tiny.store("qwen3_moe"), tiny.checkpoint("qwen3_moe"), *flags)
    assert rc == 1 and message in err and "Traceback" not in err


def test_no_native_is_taken_and_two_token_chunks_score_one_each(tiny, capsys):
    rc, out, err = quality(capsys, tiny.store("qwen3_moe"), tiny.checkpoint("qwen3_moe"),
                           "--no-native", "--ctx", "2", "--chunks", "3")  # fmt: skip
    assert rc == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    assert line["chunks"] == 3 and line["scored_tokens"] == 3


def test_chunks_needs_two_tokens_a_chunk():
    with pytest.raises(ValueError, match="needs 2 or more"):
        chunks(list(range(10)), ctx=1)
    assert chunks(list(range(10)), ctx=2).shape == (5, 2)
