"""`moetier generate STORE --prompt TEXT | --chat TEXT`: stream a completion to stdout, then a
line of speed figures to stderr."""

from __future__ import annotations

import argparse
import sys

from moetier.cli.common import add_model_arguments, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw text to continue")
    what.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    parser.add_argument("--system", help="system message for --chat")


def run(args: argparse.Namespace) -> int:
    generator, params = load(args)
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        prompt_ids = generator.chat_prompt_ids(messages)
    else:
        prompt_ids = generator.prompt_ids(args.prompt)
    for delta in generator.stream(prompt_ids, params, chat=args.chat is not None):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"moetier: {generator.timing.summary()}", file=sys.stderr)
    return 0
