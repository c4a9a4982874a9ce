"""Expert parallel on CPU: two gloo processes on one host over loopback, as torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; multi-node runs use the same variables) or
as `--gpus 2` spawns them. The greedy tokens must equal one process's, with each rank holding
only its share of the experts; a rank that fails or stops answering must end the run with an
error that says so, not a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moetier.parallel.launch import free_port

WORKER = Path(__file__).parent / "ep_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("TRITON_INTERPRET", "1")
    env.update(extra)
    return env


def _one_process(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(WORKER), *args], env=_env(), capture_output=True,
                         text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _torchrun_ranks(ranks: int, *args: str, timeout: float = 120, **env: str) -> list:
    """`ranks` worker processes with torchrun's variables: (returncode, stdout, stderr) each."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            env=_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                TORCHELASTIC_RUN_ID="test",  # as torchrun starts its workers
                **env,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for r in range(ranks)
    ]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _trace(store: str, path: Path, hot: int = 0) -> str:
    """A routing trace of `store`'s MoE layers where expert `hot` takes half the pairs."""
    from moetier.quant.store import Store

    s = Store(store)
    experts = s.model_config.num_experts
    p = np.full(experts, 0.5 / (experts - 1))
    p[hot] = 0.5
    ids = np.random.default_rng(0).choice(experts, size=(len(s.moe_layers), 64, 2), p=p)
    np.savez(path, expert_ids=ids)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_two_ranks_give_one_process_tokens(tiny, model_type, tmp_path):
    store = str(tiny.store(model_type))
    alone = _one_process(store)
    args = [store]
    if model_type == "deepseek_v3":  # the hotness path: experts split by a routing trace
        args += ["--hotness", _trace(store, tmp_path / "trace.npz")]
    results = _torchrun_ranks(2, *args)
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    line = json.loads(results[0][1].strip().splitlines()[-1])
    assert line["tokens"] == alone["tokens"]
    assert line["ranks"] == 2 and line["forwards"] > 0 and line["combines"] > 0
    owned = {int(layer): set(experts) for layer, experts in line["owned"].items()}
    for experts in owned.values():
        assert 0 < len(experts) < 8  # split: rank 0 owns some of each layer's experts, not all
    assert all(e in owned[layer] for layer, e in line["resident"])  # only its own are cached
    assert not results[1][1].strip()  # the follower prints nothing


def test_finished_ranks_end_without_the_interpreters_teardown(tiny):
    """Each rank of a finished run ends at once once its groups are closed (group.end_process:
    gloo's threads can abort a process in the interpreter's teardown, exit -6 after its work,
    seen in a loaded CI run about once in 50 runs): no atexit handler runs, the output is
    all there, the status is 0. A process that joined no run exits as usual."""
    store = str(tiny.store("qwen3_moe"))
    results = _torchrun_ranks(2, store, "--atexit")
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
        assert "interpreter teardown" not in stderr
    assert json.loads(results[0][1].strip().splitlines()[-1])["ranks"] == 2  # flushed
    alone = subprocess.run([sys.executable, str(WORKER), store, "--atexit"], env=_env(),
                           capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert alone.returncode == 0 and "interpreter teardown" in alone.stderr


@pytest.mark.slow
def test_generate_gpus_2_spawns_ranks_with_the_same_text(tiny):
    store = str(tiny.store("qwen3_moe"))
    command = [sys.executable, "-m", "moetier", "generate", store, "--prompt", "hello there",
               "--max-new-tokens", "10", "--temperature", "0", "--device", "cpu"]  # fmt: skip
    one = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    two = subprocess.run(command + ["--gpus", "2"], env=_env(), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()


def test_a_closed_stdout_under_gpus_2_ends_quietly(tiny):
    """`moetier generate --gpus 2 ... | head -c 1`: the reader goes away; the run ends with
    status 141 as one process does (128 + SIGPIPE), not as a failed rank."""
    store = str(tiny.store("qwen3_moe"))
    command = [sys.executable, "-m", "moetier", "generate", store, "--prompt", "hello there",
               "--max-new-tokens", "40", "--temperature", "0", "--device", "cpu",
               "--gpus", "2"]  # fmt: skip
    with subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the first token
        stderr = proc.stderr.read()
        status = proc.wait(timeout=120)
    assert status == 141, stderr[-3000:]
    assert "failed" not in stderr and "exited with status" not in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_failing_rank_stops_the_run_with_its_error(tiny):
    store = str(tiny.store("qwen3_moe"))
    command = [sys.executable, str(WORKER), store, "--spawn", "2", "--fail-rank", "1"]
    out = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0
    assert "rank 1 fails on purpose" in out.stderr
    assert "rank 1 of 2 exited with status 1" in out.stderr


def test_ranks_that_would_route_differently_are_refused_before_any_step(tiny, tmp_path):
    """Rank 1 given another --expert-hotness file splits the experts another way: pairs would
    be dropped or doubled without an error, so every rank refuses at load, naming it."""
    store = str(tiny.store("qwen3_moe"))
    results = _torchrun_ranks(2, store, "--hotness", _trace(store, tmp_path / "a.npz", hot=0),
                              "--rank1-hotness", _trace(store, tmp_path / "b.npz", hot=5),
                              timeout=60)  # fmt: skip
    for code, _, stderr in results:
        assert code != 0
        assert "do not agree with rank 0 on what decides routing (rank 1: partition)" in stderr


def test_an_error_inside_rank_0s_forward_ends_the_run_at_once(tiny):
    """Rank 0 raises inside a forward the other ranks run with it (after a MoE layer's
    combine), and its engine loop catches the error and goes on, as the server's does: the run
    ends within seconds with rank 0's error, not after MOETIER_DIST_TIMEOUT stuck in a
    combine."""
    store = str(tiny.store("qwen3_moe"))
    command = [sys.executable, str(WORKER), store, "--spawn", "2", "--raise-in-step", "3"]
    began = time.perf_counter()
    out = subprocess.run(command, env=_env(MOETIER_DIST_TIMEOUT="120"), capture_output=True,
                         text=True, timeout=110, cwd=ROOT)  # fmt: skip
    assert out.returncode != 0
    assert "out of memory (simulated, rank 0 only)" in out.stderr
    assert "rank 0 failed inside a forward" in out.stderr
    assert time.perf_counter() - began < 100


@pytest.mark.slow
def test_a_silent_rank_times_out_with_a_clear_error():
    results = _torchrun_ranks(2, "unused", "--hang-rank", "1", timeout=60, MOETIER_DIST_TIMEOUT="3")
    code, stdout, stderr = results[0]
    assert code == 0, stderr[-3000:]
    error = json.loads(stdout.strip().splitlines()[-1])
    assert "expert combine of MoE layer 3 failed" in error["error"]
    assert "did not join within 3 s" in error["error"]
    assert error["seconds"] < 30


def test_a_missing_rank_fails_the_join_with_a_clear_error(tiny):
    port = str(free_port())
    out = subprocess.run(
        [sys.executable, str(WORKER), str(tiny.store("qwen3_moe"))],
        env=_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="test",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, MOETIER_DIST_TIMEOUT="2"),
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode != 0
    assert "rank 0 of 2 could not join the others" in out.stderr


def test_gpus_beyond_this_machine_is_refused_with_what_to_do():
    from moetier.config import EngineConfig
    from moetier.parallel.launch import check_devices, wanted_ranks

    with pytest.raises(ValueError, match="--gpus 2 needs 2 GPUs and this machine has 0"):
        check_devices(EngineConfig(gpus=2), 2)
    check_devices(EngineConfig(gpus=2, device="cpu"), 2)  # CPU processes over gloo
    assert wanted_ranks(EngineConfig()) == 1
    with pytest.raises(ValueError, match="give 1 or more"):
        wanted_ranks(EngineConfig(gpus=-1))


def test_inherited_rank_variables_do_not_make_a_default_run_join(monkeypatch):
    """A moetier started from a script that a cluster job or torchrun launched inherits RANK
    and WORLD_SIZE: left out, --gpus joins torchrun's ranks only where torchrun started this
    process; an explicit --gpus 1 is one process whatever the environment says."""
    from moetier.config import EngineConfig
    from moetier.parallel.launch import TORCHRUN_ENV, wanted_ranks

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv(TORCHRUN_ENV, raising=False)
    assert wanted_ranks(EngineConfig()) == 1  # a cluster job's variables, no torchrun
    monkeypatch.setenv(TORCHRUN_ENV, "job-1")
    assert wanted_ranks(EngineConfig()) == 4  # started by torchrun: its ranks
    assert wanted_ranks(EngineConfig(gpus=1)) == 1  # asked for one process
    assert wanted_ranks(EngineConfig(gpus=4)) == 4
    with pytest.raises(ValueError, match="torchrun started 4 ranks"):
        wanted_ranks(EngineConfig(gpus=2))


def test_what_expert_parallel_does_not_do_yet_is_refused(tiny):
    from moetier.config import EngineConfig
    from moetier.parallel.launch import rank_config

    store = tiny.store("qwen3_moe")
    with pytest.raises(ValueError, match="speculative decoding"):
        rank_config(EngineConfig(mtp=True), store)
    with pytest.raises(ValueError, match="native model files"):
        rank_config(EngineConfig(native=False), store)
    config = rank_config(EngineConfig(), store)
    assert not config.cuda_graph and not config.lookahead and not config.compile_decode


@pytest.mark.slow
def test_bench_gpus_2_shares_one_synthetic_store():
    command = [sys.executable, "-m", "moetier", "bench", "--shape", "tiny", "--layers", "2",
               "--device", "cpu", "--gpus", "2", "--batch", "2", "--prompt-tokens", "8",
               "--new-tokens", "4", "--warmup", "0", "--json",
               "--expert-cache-slots", "8"]  # fmt: skip
    out = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["gpus"] == 2 and line["batch"] == 2 and line["decode_tok_s"] > 0
    assert out.stderr.count("writing a synthetic tiny store") == 1  # written once, for both
