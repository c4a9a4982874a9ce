"""How a verb (generate, serve, bench) runs on several ranks.

`run(body, verb, args, engine_config, store)`: with `--gpus 1` and no torchrun environment,
`body(Session())` as before, in this process, nothing else done. With `--gpus N` in a plain
process: N processes on this host (torch.multiprocessing, start method spawn), each running
the verb module's `run(args)` again as one rank, with torchrun's variables set (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR 127.0.0.1, a free MASTER_PORT). Started by torchrun (RANK in
the environment): this process is one rank of WORLD_SIZE, on one node or several. Each rank
joins the groups (group.py) and loads the store with its share of the experts; rank 0 runs
`body` (the scheduler, the server) with a session whose `load_model` installs the step hook
(step.py), the others follow its forwards until it stops them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetier.config import EngineConfig
from moetier.core.stdout import STDOUT_CLOSED, stdout_closed
from moetier.loader.load import load_model
from moetier.loader.loaded_model import LoadedModel
from moetier.parallel.experts import expert_shard
from moetier.parallel.group import RankGroup, join, launched_ranks
from moetier.parallel.step import StepLeader, follow
from moetier.quant.store import Store


@dataclass
class Session:
    """How a verb loads its model in this process: as one process (no group), or as rank 0 of
    an expert-parallel run."""

    group: RankGroup | None = None
    leader: StepLeader | None = None

    @property
    def ranks(self) -> int:
        return self.group.ranks if self.group is not None else 1

    def load_model(
        self,
        store: str | Path,
        engine_config: EngineConfig,
        kv_positions: int | None = None,
    ) -> LoadedModel:
        """loader.load_model; on rank 0 of several, with its share of the experts and every
        decoder forward sent to the other ranks first."""
        if self.group is None:
            return load_model(store, engine_config, kv_positions)
        loaded = load_rank_model(store, engine_config, kv_positions, self.group)
        self.leader = StepLeader(loaded.model, self.group)
        return loaded

    def stop(self) -> None:
        """Rank 0, after the verb's work: end the followers."""
        if self.leader is not None:
            self.leader.stop()


def wanted_ranks(engine_config: EngineConfig) -> int:
    """The run's rank count: --gpus N; left out (0), torchrun's WORLD_SIZE where torchrun
    started this process (TORCHELASTIC_RUN_ID), else 1. An explicit --gpus 1 is one process
    whatever RANK / WORLD_SIZE the environment holds (a moetier started from a script that
    torchrun or a cluster job launched inherits them)."""
    gpus = engine_config.gpus
    if gpus < 0:
        raise ValueError(f"--gpus {gpus}: give 1 or more (or leave it out)")
    launched = launched_ranks()
    if gpus == 0:
        return launched if launched > 1 and TORCHRUN_ENV in os.environ else 1
    if gpus > 1 and launched > 1 and gpus != launched:
        raise ValueError(
            f"--gpus {gpus} but torchrun started {launched} ranks (WORLD_SIZE): "
            "leave --gpus out under torchrun, or make them equal"
        )
    return gpus


# set by torchrun (torch.distributed.elastic) in the processes it starts
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"


def rank_config(engine_config: EngineConfig, store: str | Path) -> EngineConfig:
    """The engine config every rank runs: eager steps (rank 0's decoder forwards are what the
    followers replay; a CUDA graph would skip the hook); ValueError for what expert parallel
    does not do yet, saying what to change."""
    if engine_config.mtp or engine_config.mtp_file:
        raise ValueError(
            "speculative decoding (--speculative-tokens, --mtp, --mtp-file) is not built for "
            "--gpus N yet: its MTP layer runs outside the steps the other ranks follow"
        )
    if not engine_config.native:
        raise ValueError("--gpus N runs native model files: drop --no-native")
    if engine_config.delta not in ("all", "none") and Store(store).has_plane("delta"):
        raise ValueError(
            f"--delta {engine_config.delta}: with --gpus N the gate's per-row inputs live on "
            "rank 0 only; use --delta all or none"
        )
    return dataclasses.replace(engine_config, cuda_graph=False, compile_decode=False,
                               lookahead=False)  # fmt: skip


def load_rank_model(
    store: str | Path, engine_config: EngineConfig, kv_positions: int | None, group: RankGroup
) -> LoadedModel:
    """This rank's model: the store with its share of the experts (parallel/experts.py)."""
    config = rank_config(engine_config, store)
    opened = Store(store)
    try:
        shard = expert_shard(opened, config, group)
    finally:
        opened.close()
    return load_model(store, config, kv_positions, shard)


def run(
    body: Callable[[Session], int],
    verb: str,
    args: argparse.Namespace,
    engine_config: EngineConfig,
    store: str | Path,
    kv_positions: int | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run a verb's `body` as the run's ranks ask (module docstring). `verb`: the module whose
    `run(args)` each spawned rank calls; `store`, `kv_positions`: what the followers load;
    `env`: variables the spawned ranks get (e.g. a store written once for all of them)."""
    ranks = wanted_ranks(engine_config)
    if ranks == 1:
        return body(Session())
    if "RANK" not in os.environ:
        check_devices(engine_config, ranks)
        return spawn(verb, args, ranks, env or {})
    group = join(engine_config.resolved_device())
    finished = False
    try:
        if not group.leader:
            loaded = load_rank_model(store, engine_config, kv_positions, group)
            follow(loaded.model, group, loaded.device)
            finished = True
            return 0
        session = Session(group)
        status = body(session)
        session.stop()  # (not after an error: the launcher stops the other ranks then)
        finished = True
        return status
    finally:
        group.close(finished)


def check_devices(engine_config: EngineConfig, ranks: int) -> None:
    """--gpus N on one host: N CUDA GPUs here, or --device cpu (gloo processes)."""
    import torch

    if engine_config.device == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < ranks:
        raise ValueError(
            f"--gpus {ranks} needs {ranks} GPUs and this machine has {count}: lower --gpus, "
            "start ranks on several nodes with torchrun (docs/multi-gpu.md), or give "
            "--device cpu to run the ranks as CPU processes (gloo; for tests)"
        )


def free_port() -> int:
    """A TCP port free on the loopback interface now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(verb: str, args: argparse.Namespace, ranks: int, env: dict[str, str]) -> int:
    """`ranks` processes on this host, each `verb`'s run(args) as one rank (`_rank_main`);
    when one fails the others are stopped and this raises SystemExit naming it. Ctrl-C or
    SIGTERM here: rank 0 gets SIGINT (a server shuts down and stops the followers), the rest
    are terminated after GRACE_S seconds."""
    import signal

    import torch.multiprocessing as mp

    port = free_port()
    context = mp.start_processes(_rank_main, args=(verb, args, ranks, port, env), nprocs=ranks,
                                 join=False, start_method="spawn")  # fmt: skip

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        _shut_down(context.processes)
        return 130
    except mp.ProcessRaisedException as err:
        raise SystemExit(
            f"moetier: rank {err.error_index} of {ranks} failed and the other ranks were "
            f"stopped:\n{err.msg}"
        ) from None
    except mp.ProcessExitedException as err:
        if err.exit_code == STDOUT_CLOSED:  # the reader went away: no rank failed
            return STDOUT_CLOSED
        raise SystemExit(
            f"moetier: rank {err.error_index} of {ranks} exited with status {err.exit_code} "
            "(its error above) and the other ranks were stopped"
        ) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


GRACE_S = 15.0  # what an interrupted run gives rank 0 to stop the others before they are killed


def _shut_down(processes: list[Any]) -> None:
    """SIGINT to rank 0, then every rank still running after GRACE_S terminated."""
    import signal
    import time

    if processes and processes[0].is_alive() and processes[0].pid is not None:
        os.kill(processes[0].pid, signal.SIGINT)
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(5)


def _rank_main(
    index: int, verb: str, args: argparse.Namespace, ranks: int, port: int, env: dict[str, str]
) -> None:
    """One spawned rank: torchrun's variables, then the verb; a ValueError is its message and
    exit status 1, as `moetier` prints one."""
    os.environ.update(env)
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(ranks),
                      LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    module: Any = importlib.import_module(verb)
    try:
        status = int(module.run(args) or 0)
        sys.stdout.flush()  # (a reader gone by now fails here, not at exit)
    except BrokenPipeError:  # `moetier generate --gpus 2 ... | head`: as the CLI's main
        status = stdout_closed()
    except (ValueError, FileNotFoundError) as err:
        print(f"moetier (rank {index} of {ranks}): error: {err}", file=sys.stderr)
        sys.exit(1)
    from moetier.parallel.group import end_process

    sys.exit(end_process(status))
