from __future__ import annotations

import json
import math
import subprocess
import sys

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
