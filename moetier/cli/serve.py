"""`moetier serve STORE`: OpenAI- and Anthropic-compatible HTTP server (default 127.0.0.1:8000)
over the serving engine: many requests at once, the model loaded in the background (`/health`
answers 503 until it is ready); API keys, model-name aliases, CORS and request limits from the
HTTP flags (server/options.py, docs/serving.md)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetier.cli.common import add_model_arguments, sampling_params
from moetier.cli.flags import add_dataclass_arguments, dataclass_from_args
from moetier.config import EngineConfig
from moetier.engine.engine import EngineLimits
from moetier.server.options import ServerOptions

# seconds a shutdown (SIGTERM, Ctrl-C) waits for open connections before closing them
GRACEFUL_SHUTDOWN_S = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_dataclass_arguments(parser, EngineLimits, "serving")
    add_dataclass_arguments(parser, ServerOptions, "HTTP (docs/serving.md)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1; another without --api-key warns)",
    )
    parser.add_argument("--port", type=_port, default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--model-name", help="model id reported by /v1/models (default: the store's name)"
    )
    parser.add_argument(
        "--recipe",
        metavar="NAME|PATH",
        help="a recipe's settings (model, budgets, context, parser; docs/recipes.md) as the "
        "defaults, which flags given beside it override; `--recipe list` lists the shipped ones",
    )


def argument_defaults(argv: list[str]) -> dict[str, Any]:
    """Argument defaults that depend on the command line: those of `--recipe NAME|PATH`
    (cli/recipes.py; KV pages counted at the --page-size given, if any)."""
    from moetier.cli import recipes

    name = recipes.recipe_from_argv(argv)
    if name is None or name == "list":
        return {}
    page = argparse.ArgumentParser(add_help=False)
    page.add_argument("--page-size", type=int, default=EngineLimits().page_size)
    page_size = page.parse_known_args(argv)[0].page_size
    return recipes.serve_defaults(recipes.load(name), page_size)


def run(args: argparse.Namespace) -> int:
    if args.recipe == "list":
        from moetier.cli import recipes

        print(recipes.listing())
        return 0
    if args.recipe:
        print(
            f"moetier serve: recipe {args.recipe}: its settings are the defaults", file=sys.stderr
        )
    from moetier.loader.load import check_engine_config
    from moetier.parallel import launch

    engine_config = dataclass_from_args(EngineConfig, args)
    sampling_params(args)  # the request defaults' flags checked before the server starts
    limits = dataclass_from_args(EngineLimits, args)
    if limits.speculative_tokens > 0:  # drafts come from the model's MTP layer
        engine_config = dataclasses.replace(engine_config, mtp=True)
    kv_positions = (limits.num_pages + 1) * limits.page_size  # the page pool and its scratch page
    ranks = launch.wanted_ranks(engine_config)
    check_engine_config(args.store, engine_config, kv_positions, ranks)  # a bad store or budget
    # --gpus N: N ranks, the server on rank 0 (moetier/parallel/launch.py)
    return launch.run(lambda session: _serve(args, engine_config, limits, session), __name__,
                      args, engine_config, args.store, kv_positions)  # fmt: skip


def _serve(args: argparse.Namespace, engine_config: EngineConfig, limits: EngineLimits,
           session: Any) -> int:  # fmt: skip
    import uvicorn

    from moetier.engine.async_engine import AsyncEngine
    from moetier.engine.engine import Engine
    from moetier.server.app import create_app
    from moetier.server.auth import keys_from

    params = sampling_params(args)
    kv_positions = (limits.num_pages + 1) * limits.page_size
    name = args.model_name or Path(args.store).resolve().name
    if engine_config.resolved_device() == "cpu" and session.ranks == 1:
        import torch

        torch.set_num_threads(serving_threads(os.environ, torch.get_num_threads()))
    options = dataclass_from_args(ServerOptions, args)
    options = dataclasses.replace(options, api_key=keys_from(options.api_key))
    if not options.api_key and not _loopback(args.host):
        print(
            f"moetier serve: warning: listening on {args.host} without an API key: anyone who "
            "can reach this port can use the model (set --api-key or MOETIER_API_KEY)",
            file=sys.stderr,
        )

    def build() -> AsyncEngine:
        return AsyncEngine(Engine(session.load_model(args.store, engine_config, kv_positions),
                                  limits))  # fmt: skip

    server: uvicorn.Server | None = None

    def stop() -> None:  # the model did not load: nothing to serve (the error is printed)
        if server is not None:
            server.should_exit = True

    app = create_app(build, name, params, options=options, on_load_failure=stop)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (loading)", flush=True)
    server = _server_class()(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=getattr(args, "log_level", "info"),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    server.run()  # (a port it cannot bind: uvicorn says so and exits with status 3)
    return 1 if app.state.server.load_error else 0


def serving_threads(env: Mapping[str, str], default: int) -> int:
    """torch's threads for a server computing on the CPU: one fewer than torch's default (a
    thread for each physical core), so that the HTTP loop, the tokenizer and the rest of the
    machine keep a core; OMP_NUM_THREADS, when set, as given. With every core busy computing,
    another process taking one stalls each step at OpenMP's barrier: requests on a 2-core box
    took 6 to 15 s instead of 0.5 s while a second process ran (the demo model, 30 tokens)."""
    if env.get("OMP_NUM_THREADS", "").strip():
        return max(1, default)
    return max(1, default - 1)


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which first tells the engine to stop when a signal asks it to:
        open requests then end with their API's error (a stream's error event, a 503) inside
        the graceful window, instead of being cut when it runs out."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            state = getattr(self.config.app, "state", None)
            server_state = getattr(state, "server", None) if state is not None else None
            if server_state is not None and server_state.engine is not None:
                server_state.engine.shutdown()
            super().handle_exit(sig, frame)

    return Server


def _port(text: str) -> int:
    """--port: a TCP port, 1 to 65535 (a larger one crashed the server at bind)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port from 1 to 65535")
    return port


def _loopback(host: str) -> bool:
    """Whether `host` only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False
