"""`moetier serve STORE`: OpenAI-compatible HTTP server (default 127.0.0.1:8000)."""

from __future__ import annotations

import argparse

from moetier.cli.common import add_model_arguments, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--model-name", help="model id reported by /v1/models (default: the store's name)"
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from moetier.server.app import create_app

    generator, params = load(args)
    name = args.model_name or generator.loaded.name
    print(f"serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(
        create_app(generator, name, params, telemetry=generator.loaded.runtime.telemetry),
        host=args.host,
        port=args.port,
        log_level="info",
    )
    return 0
