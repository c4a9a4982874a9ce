"""`moetier generate STORE --prompt TEXT | --chat TEXT`: stream a completion to stdout, then a
line of speed figures to stderr. One request through the serving engine (engine/engine.py), the
path `moetier serve` and `moetier bench` run: the same compiled, graphed decode step."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from moetier.cli.common import add_model_arguments, sampling_params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw text to continue")
    what.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    parser.add_argument("--system", help="system message for --chat")
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="speculative decoding with the model's MTP layer (the store's, or --mtp-file): "
        "drafts per step (default: 0, off)",
    )


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ValueError for --system without --chat: a raw --prompt has no chat template to put a
    system message in (it was silently dropped)."""
    if args.system is not None and args.chat is None:
        raise ValueError(
            "--system goes with --chat (the chat template places it before the user message); "
            "a --prompt is raw text: write the system text into it, or use --chat"
        )


def run(args: argparse.Namespace) -> int:
    from moetier.cli.flags import dataclass_from_args
    from moetier.config import EngineConfig
    from moetier.parallel import launch

    engine_config = dataclass_from_args(EngineConfig, args)
    sampling_params(args)  # its flags checked before the model loads
    if args.speculative_tokens > 0:  # drafts come from the model's MTP layer
        engine_config = dataclasses.replace(engine_config, mtp=True)
    # --gpus N: N ranks, this body on rank 0 (moetier/parallel/launch.py)
    return launch.run(lambda session: _generate(args, engine_config, session), __name__, args,
                      engine_config, args.store)  # fmt: skip


def _generate(args: argparse.Namespace, engine_config: Any, session: Any) -> int:
    from moetier.engine.engine import Engine, EngineLimits
    from moetier.engine.prompts import chat_prompt_ids
    from moetier.engine.timing import GenerationTiming

    params = sampling_params(args)
    loaded = session.load_model(args.store, engine_config)
    tokenizer = loaded.tokenizer
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        prompt_ids = chat_prompt_ids(tokenizer, messages)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    context = int(loaded.model.config.max_position_embeddings)
    if len(prompt_ids) >= context:  # (the engine's error names the server's max_tokens)
        raise ValueError(_too_long(args, len(prompt_ids), context, params.max_new_tokens))
    positions = min(context, len(prompt_ids) + params.max_new_tokens)
    page = EngineLimits().page_size
    positions += max(0, args.speculative_tokens)  # the last step's drafts
    limits = EngineLimits(num_pages=-(-positions // page) + 1, max_num_seqs=1,
                          speculative_tokens=args.speculative_tokens)  # fmt: skip
    engine = Engine(loaded, limits)
    timing = GenerationTiming(rows=1, prompt_tokens=len(prompt_ids))
    start = time.perf_counter()
    request = engine.add("generate", prompt_ids, params, chat=args.chat is not None)
    first: float | None = None
    while engine.has_work:
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
        now = time.perf_counter()
        if first is None and request.output:
            first = now
            timing.prefill_seconds = now - start
        elif first is not None:
            timing.decode_seconds = now - first
    timing.new_tokens = len(request.output)
    timing.steps = timing.new_tokens
    spec = engine.spec_stats()
    if spec is not None and spec.steps:
        shares = [round(a / d, 3) for a, d in zip(spec.accepted, spec.drafted, strict=True) if d]
        print(f"moetier: speculative: {spec.mean_accepted + 1:.2f} tokens a verify step, "
              f"drafts accepted by position {shares}", file=sys.stderr)  # fmt: skip
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"moetier: {timing.summary()}", file=sys.stderr)
    return 0


def _too_long(args: argparse.Namespace, prompt: int, context: int, new: int) -> str:
    """What to change when a prompt of `prompt` tokens leaves no room in a `context`-token
    context for the `new` tokens --max-new-tokens asks for, in this verb's flags."""
    flag = "--prompt" if args.chat is None else "--chat (with --system and the chat template)"
    said = f"the prompt is {prompt} tokens and this model's context holds {context}"
    if context - new >= 1:
        return (
            f"{said}, the prompt and the {new} new tokens of --max-new-tokens together: shorten "
            f"{flag} to {context - new} tokens or fewer"
        )
    return (
        f"{said}: shorten {flag} to fewer than {context} tokens (--max-new-tokens {new} is more "
        "than the context holds: generation stops where it is full)"
    )
