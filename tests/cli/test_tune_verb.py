"""`moetier tune` on a machine without a GPU: says what it needs and what to do, non-zero."""

from __future__ import annotations

import pytest
import torch

from moetier.cli.main import main


def test_tune_without_a_gpu_says_it_needs_one(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (also on a GPU machine)
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path))
    assert main(["tune", "--shape", "qwen3-30b-a3b"]) == 1
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "Run `moetier tune` on the machine with the GPU" in err
    assert not (tmp_path / "kernels").exists()  # nothing written


def test_tune_wants_a_store_or_a_shape(capsys):
    assert main(["tune"]) == 2
    assert "give a STORE or --shape NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--shape", "qwen3-30b-a3b", "--time-budget", "soon"])
