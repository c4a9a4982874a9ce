"""What a user sees when a run cannot start or stops early: one line on stderr saying what is
wrong and what to do, never a traceback (a user audit's findings, run through the CLI's entry
point in-process, or as a subprocess where the process itself is what is checked)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from moetier.cli.main import main
from moetier.config import EngineConfig


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line `moetier ARGV` writes to stderr as it exits with status 1."""
    capsys.readouterr()  # (what building a fixture printed)
    status = main(list(argv))
    err = capsys.readouterr().err
    assert status == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("dtype", ["int8", "bool", "float8_e4m3fn", "float64", "uint8"])
def test_dtype_is_a_compute_dtype(tiny, capsys, dtype):
    store = str(tiny.store("qwen3_moe"))
    line = error_of(capsys, "generate", store, "--prompt", "hi", "--device", "cpu",
                    "--dtype", dtype)  # fmt: skip
    assert line == (
        f"moetier generate: error: --dtype {dtype!r}: choose one of float32, bfloat16, float16 "
        "or auto (the dtype the model computes in)"
    )
    from moetier.config import COMPUTE_DTYPES

    assert COMPUTE_DTYPES == ("float32", "bfloat16", "float16")
    assert EngineConfig(dtype="bfloat16").resolved_dtype("float32") == "bfloat16"
    assert EngineConfig(device="cpu").resolved_dtype("bfloat16") == "float32"  # auto on CPU


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x", "xla"])
def test_device_moetier_does_not_run_on(tiny, capsys, device):
    line = error_of(capsys, "generate", str(tiny.store("qwen3_moe")), "--prompt", "hi",
                    "--device", device)  # fmt: skip
    assert line == f"moetier generate: error: --device {device!r}: use cuda, cuda:N, cpu or auto"


@pytest.mark.parametrize("built", [True, False])
def test_cuda_device_on_a_machine_without_one(tiny, capsys, monkeypatch, built):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", "12.8" if built else None)
    line = error_of(capsys, "generate", str(tiny.store("qwen3_moe")), "--prompt", "hi",
                    "--device", "cuda")  # fmt: skip
    why = "finds no GPU" if built else "is built without CUDA"
    assert line == (
        f"moetier generate: error: --device cuda: this machine's torch {why}: use --device cpu "
        "(or auto, which takes a CUDA GPU where there is one)"
    )
    assert EngineConfig().resolved_device() == "cpu"  # auto


def test_cuda_index_past_the_gpus(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert EngineConfig(device="cuda:1").resolved_device() == "cuda:1"
    with pytest.raises(ValueError, match=r"^--device cuda:2: this machine has 2 CUDA GPU\(s\), "):
        EngineConfig(device="cuda:2").resolved_device()


def test_bench_checks_the_device_before_writing_a_synthetic_store(capsys, monkeypatch):
    import moetier.quant.synthetic as synthetic

    def refuse(*args, **kwargs):
        raise AssertionError("a synthetic store was written for a run that cannot start")

    monkeypatch.setattr(synthetic, "write_synthetic_store", refuse)
    line = error_of(capsys, "bench", "--shape", "qwen3-30b-a3b", "--layers", "1",
                    "--device", "tpu")  # fmt: skip
    assert line == "moetier bench: error: --device 'tpu': use cuda, cuda:N, cpu or auto"


def run_into_a_closed_pipe(argv: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess:
    """`python -m moetier ARGV` whose stdout is a pipe nobody reads any more (`| head -c 5`
    after its five bytes: here the reader is gone before the first byte)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "moetier", *argv], input=stdin,
                              stdout=write, stderr=subprocess.PIPE, timeout=300)  # fmt: skip
    finally:
        os.close(write)


def test_generate_into_a_closed_pipe_stops_quietly(tiny):
    done = run_into_a_closed_pipe(["generate", str(tiny.store("qwen3_moe")), "--prompt", "hello",
                                   "--max-new-tokens", "200", "--device", "cpu"])  # fmt: skip
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr.decode()
    assert done.stderr == b""


def test_parse_stream_into_a_closed_pipe_stops_quietly():
    done = run_into_a_closed_pipe(["parse", "--family", "hermes", "--stream"], b"hello\n" * 20000)
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr.decode()
    assert done.stderr == b""


def test_a_store_without_tokenizer_files_is_refused_naming_it(tiny, tmp_path, capsys):
    """transformers builds an empty tokenizer from tokenizer_config.json alone: generate said
    "the prompt is empty" and serve started with it. Both refuse the store before loading."""
    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    (store / "tokenizer.json").unlink()
    assert (store / "tokenizer_config.json").is_file()
    want = (
        f"{store} has no tokenizer files (tokenizer.json, tokenizer.model, *.tiktoken, "
        "vocab.json or vocab.txt): copy the original model's into it, or convert the model "
        "again with --tokenizer PATH naming a folder that has them"
    )
    line = error_of(capsys, "generate", str(store), "--prompt", "hello", "--device", "cpu")
    assert line == f"moetier generate: error: {want}"
    line = error_of(capsys, "serve", str(store), "--device", "cpu", "--port", "1")  # never bound
    assert line == f"moetier serve: error: {want}"
    from moetier.loader.hf_model import load_transformers

    with pytest.raises(ValueError, match="has no tokenizer files"):  # the loader's own check
        load_transformers(store, EngineConfig(device="cpu"))


def test_max_new_tokens_0_is_refused_as_the_server_refuses_max_tokens_0(tiny, capsys):
    """The engine generates at least one token: `generate --max-new-tokens 0` printed one. It
    and serve's default for requests are refused before the model loads."""
    store = str(tiny.store("qwen3_moe"))
    want = "--max-new-tokens 0: give 1 or more (each run generates at least one token)"
    line = error_of(capsys, "generate", store, "--prompt", "hi", "--max-new-tokens", "0")
    assert line == f"moetier generate: error: {want}"
    line = error_of(capsys, "serve", store, "--max-new-tokens", "0", "--port", "1")
    assert line == f"moetier serve: error: {want}"
    line = error_of(capsys, "generate", store, "--prompt", "hi", "--max-new-tokens", "-3")
    assert line.startswith("moetier generate: error: --max-new-tokens -3: give 1 or more")


def test_bench_stopped_by_sigterm_removes_its_synthetic_store(tmp_path):
    """SIGINT removed the temporary store of `bench --shape` (500 MB for qwen3-30b-a3b at two
    layers); SIGTERM left it behind. Now it is removed too, and the status is 128 + SIGTERM."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier", "bench", "--shape", "tiny", "--layers", "1",
         "--device", "cpu", "--prompt-tokens", "8", "--new-tokens", "4000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # the store is written and the run under way
        said.append(line)
        if line.startswith("moetier bench: loading"):
            break
    assert [p.name for p in tmp_path.glob("moetier-bench-*")], said
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(said) + rest
    assert "Traceback" not in rest
    assert not list(tmp_path.glob("moetier-bench-*"))


def test_context_overflow_names_the_verbs_flags_and_numbers(tiny, capsys):
    """A prompt past the context said "(N in the prompt, 1 to generate): ... lower max_tokens":
    no such flag there, and 8 tokens were asked for. generate and bench name their own flags
    and the numbers given (the tiny model's context is 256 tokens)."""
    from transformers import AutoTokenizer

    store = str(tiny.store("qwen3_moe"))
    text = "hello world " * 200
    n = len(AutoTokenizer.from_pretrained(store).encode(text))
    assert n > 256
    line = error_of(capsys, "generate", store, "--prompt", text, "--max-new-tokens", "8",
                    "--device", "cpu")  # fmt: skip
    assert line == (
        f"moetier generate: error: the prompt is {n} tokens and this model's context holds "
        "256, the prompt and the 8 new tokens of --max-new-tokens together: shorten --prompt to "
        "248 tokens or fewer"
    )
    line = error_of(capsys, "generate", store, "--prompt", text, "--max-new-tokens", "300",
                    "--device", "cpu")  # fmt: skip
    assert line.endswith(
        "shorten --prompt to fewer than 256 tokens (--max-new-tokens 300 is more than the "
        "context holds: generation stops where it is full)"
    )
    line = error_of(capsys, "bench", store, "--prompt-tokens", "250", "--new-tokens", "8",
                    "--device", "cpu")  # fmt: skip
    assert line == (
        "moetier bench: error: --prompt-tokens 250 and --new-tokens 8 make rows of 258 tokens, "
        "and this model's context holds 256: lower them so that they add up to 256 or fewer"
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--mtp"], "--mtp: only the native model files read it"),
        (["--mtp-file", "x.safetensors", "--zero-copy-stage", "1"],
         "--zero-copy-stage, --mtp-file: only the native model files read them"),
        (["--expert-hotness", "trace.npz"], "--expert-hotness: only the native model files"),
    ],
)  # fmt: skip
def test_native_only_flags_are_refused_where_the_transformers_class_runs(
    tiny, capsys, flags, named
):
    """--no-native (or a family without a native file) runs the transformers class, which never
    reads these: they were dropped unsaid (`generate --no-native --mtp` decoded without drafts)."""
    store = str(tiny.store("qwen3_moe"))
    line = error_of(capsys, "generate", store, "--prompt", "hi", "--device", "cpu",
                    "--no-native", *flags)  # fmt: skip
    assert line.startswith(f"moetier generate: error: {named}"), line
    assert "(--no-native, docs/models.md): drop" in line
    line = error_of(capsys, "quality", store, "--reference", "x", "--text", "y", *flags)
    assert "quality scores the store through the transformers model class" in line, line
    # the flags at their defaults, or on the native path, are taken
    assert EngineConfig(native=False, zero_copy_stage=3).native_only_flags() == []
    assert main(["generate", store, "--prompt", "hi", "--device", "cpu", "--no-native",
                 "--max-new-tokens", "2", "--zero-copy-stage", "3"]) == 0  # fmt: skip
