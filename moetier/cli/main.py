"""`moetier <verb>`: each verb is a module with `add_arguments(parser)` and `run(args)`,
imported only when that verb runs (so `moetier --help` stays fast)."""

from __future__ import annotations

import argparse
import importlib
import sys

from moetier.core.stdout import stdout_closed

VERBS = {
    "convert": "convert a Hugging Face MoE checkpoint into a moetier store",
    "generate": "generate text from a store, streamed to stdout (its speed to stderr)",
    "serve": "serve a store over an OpenAI-compatible HTTP API",
    "quality": "KL divergence and perplexity of a store against its Hugging Face reference",
    "plan": "print where a store's weights, KV cache and experts go under memory budgets",
    "bench": "measure prefill and decode speed on this machine, next to its floor",
    "tune": "time the experts kernels' configurations on this GPU and keep the fastest",
    "verify": "check a store's index, every expert blob's checksum and dense.safetensors'",
    "parse": "split raw model output on stdin into content, reasoning and tool calls (JSON)",
}

# verbs whose checkpoint or store argument may be a Hugging Face Hub id (cli/hub.py)
HUB_VERBS = ("convert", "serve", "generate", "bench")
LOG_LEVELS = ("debug", "info", "warning", "error")
# verbs that say once, on a CUDA card without tuned kernel configs, how to tune them
TUNED_VERBS = ("serve", "generate")


def set_log_level(level: str, given: bool = True) -> None:
    """Python logging (moetier's loggers), transformers' and huggingface_hub's at `level`; their
    verbosity variables (TRANSFORMERS_VERBOSITY, HF_HUB_VERBOSITY) win unless `given`. A default
    level (not `given`) reaches the two libraries at warning at most: their info is a config dump
    on every load (serve's default is info, for moetier's and uvicorn's lines)."""
    import logging
    import os

    number = getattr(logging, level.upper())
    library = level if given or number >= logging.WARNING else "warning"
    # read when transformers and huggingface_hub first configure their loggers (later imports)
    for variable in ("TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY"):
        if given or variable not in os.environ:
            os.environ[variable] = library
    # a stderr handler where nothing has configured logging yet (not under pytest, say)
    logging.basicConfig(level=number, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("moetier").setLevel(number)
    for name in ("transformers", "huggingface_hub"):
        logger = logging.getLogger(name)
        if given or not logger.level:
            logger.setLevel(getattr(logging, library.upper()))


def quiet_library_bars() -> None:
    """Where stderr is no terminal, no progress bars from transformers and huggingface_hub
    (transformers' "Loading weights", the Hub's downloads), as moetier's own show only on a
    terminal; HF_HUB_DISABLE_PROGRESS_BARS, when set, wins. Both read the variable when first
    imported; where one already is (moetier called in-process), it is told directly."""
    import os

    if sys.stderr.isatty() or "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers.utils.logging" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def say_untuned(store: str) -> None:
    """A warning, once, where this CUDA card has neither the user's tuned kernel table nor a
    shipped one: how to tune (`moe_dispatch.untuned_hint`); nothing on CPU."""
    import logging

    import torch

    if not torch.cuda.is_available():
        return
    from moetier.kernels.moe_dispatch import untuned_hint

    hint = untuned_hint(store)
    if hint:
        logging.getLogger("moetier.cli").warning(hint)


def main(argv: list[str] | None = None) -> int:
    """`moetier VERB ...`: the verb's exit status. A process that ran as one rank of an
    expert-parallel run ends here (parallel/group.end_process)."""
    status = _main(argv)
    group = sys.modules.get("moetier.parallel.group")  # (imported only where ranks ran)
    return group.end_process(status) if group is not None else status


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="moetier", description="Run MoE LLMs larger than your GPU."
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, help_text in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] not in VERBS:
        args = parser.parse_args(argv)  # prints help or the error for an unknown verb
        parser.print_help()
        return 2
    quiet_library_bars()
    module = importlib.import_module(f"moetier.cli.{argv[0]}")
    verb_parser = argparse.ArgumentParser(prog=f"moetier {argv[0]}", description=VERBS[argv[0]])
    module.add_arguments(verb_parser)
    verb_parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="messages of moetier, transformers, huggingface_hub (and, for serve, uvicorn) at "
        "this level and above (default: info for serve, else warning)",
    )
    if argv[0] in HUB_VERBS:
        from moetier.cli import hub

        hub.add_arguments(verb_parser, argv[0])
    if hasattr(module, "argument_defaults"):  # defaults from the command line (serve --recipe)
        try:
            verb_parser.set_defaults(**module.argument_defaults(argv[1:]))
        except ValueError as err:
            print(f"moetier {argv[0]}: error: {err}", file=sys.stderr)
            return 1
    args = verb_parser.parse_args(argv[1:])
    given = args.log_level is not None
    args.log_level = args.log_level or ("info" if argv[0] == "serve" else "warning")
    set_log_level(args.log_level, given)
    try:
        if hasattr(module, "check_arguments"):  # flags that are wrong together, or out of range
            module.check_arguments(args, verb_parser)
        if argv[0] in HUB_VERBS:
            from moetier.cli import hub

            hub.resolve(args, argv[0])
        if argv[0] in TUNED_VERBS:
            say_untuned(str(args.store))
        status = int(module.run(args) or 0)
        sys.stdout.flush()  # (a reader gone by now fails here, not at exit)
        return status
    except BrokenPipeError:
        return stdout_closed()
    except (ValueError, FileNotFoundError) as err:
        print(f"moetier {argv[0]}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
