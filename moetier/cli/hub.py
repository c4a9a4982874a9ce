"""Hugging Face Hub ids where a verb takes a checkpoint or a store: `moetier convert ORG/NAME OUT`
downloads the checkpoint first; `moetier serve|generate|bench ORG/NAME` downloads it, converts it
once into the store cache (a folder named by id, revision and expert format) and runs that store;
a second run finds the store there and converts nothing.

Downloads go through huggingface_hub's `snapshot_download`, limited to the files a conversion
reads (`ALLOW_PATTERNS`): resumable, into the Hub cache (`HF_HOME`, `HF_HUB_CACHE`), offline
from that cache with `HF_HUB_OFFLINE=1`. Stores go under `MOETIER_CACHE` (default
`$XDG_CACHE_HOME/moetier`, else `~/.cache/moetier`) in `stores/`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from moetier.core.paths import cache_root
from moetier.quant.store import TOKENIZER_GLOBS

# the verbs whose first argument may be a Hub id, and that argument's name in their namespace
VERBS = {"convert": "hf_dir", "serve": "store", "generate": "store", "bench": "store"}
# what a conversion reads: config, weights and their index, tokenizer and chat-template files
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    *TOKENIZER_GLOBS,
]
# files in subfolders are never read (gpt-oss's original/ and metal/ hold second copies)
IGNORE_PATTERNS = ["*/*"]
# ORG/NAME as the Hub spells repository ids (letters, digits, '-', '_', '.'; no leading '.')
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
EXPERT_FORMATS = ("source", "q2s", "int2", "affine2", "nvfp4", "mxfp4", "nested")


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    group = parser.add_argument_group("Hugging Face Hub ids (ORG/NAME)")
    group.add_argument(
        "--revision", default=None, help="branch, tag or commit of a Hub id (default: main)"
    )
    if verb != "convert":
        group.add_argument(
            "--convert-experts",
            choices=EXPERT_FORMATS,
            default="source",
            help="expert format a Hub id is converted to, once, into the store cache "
            "($MOETIER_CACHE/stores) (default: source, as `moetier convert`)",
        )
        group.add_argument(
            "--convert-dense",
            default=None,
            metavar="FORMAT",
            help="dense format a Hub id is converted to, as `moetier convert --dense` (default: "
            "as the checkpoint has them)",
        )


def is_hub_id(value: str) -> bool:
    """Whether `value` names a Hub model rather than a local folder: ORG/NAME that is not a
    path on this machine."""
    return bool(HUB_ID.fullmatch(value)) and not Path(value).exists()


def store_dir(repo_id: str, commit: str, experts: str, dense: str | None = None) -> Path:
    """The cached store of `repo_id` at `commit` with `experts` experts (and `dense` dense
    weights where given)."""
    org, name = repo_id.split("/")
    suffix = f"--dense-{dense}" if dense else ""
    return cache_root() / "stores" / f"{org}--{name}--{commit[:12]}--{experts}{suffix}"


def download(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot of `repo_id` (downloaded or completed where needed, else straight from
    the Hub cache); ValueError saying why where it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except LocalEntryNotFoundError as err:
        raise ValueError(
            f"{repo_id} is not a local folder, and no snapshot of it (revision "
            f"{revision or 'main'}) is in the Hugging Face cache {_hub_cache()} while the Hub "
            f"cannot be reached{' (HF_HUB_OFFLINE is set)' if _offline() else ''}: {err}"
        ) from err
    except (HfHubHTTPError, OSError) as err:
        raise ValueError(
            f"{repo_id} is not a local folder, and the Hugging Face Hub did not give it: {err}"
        ) from err
    return Path(str(path))


def converted(
    repo_id: str,
    revision: str | None = None,
    experts: str = "source",
    progress: bool = True,
    dense: str | None = None,
) -> Path:
    """The store of `repo_id`: from the store cache, or downloaded and converted into it
    (`dense`: `moetier convert --dense`; None: as the checkpoint has them)."""
    from moetier.quant.dense_formats import DensePolicy

    policy = DensePolicy.parse(dense) if dense else None
    snapshot = download(repo_id, revision)
    out = store_dir(repo_id, snapshot.name, experts, dense)
    if (out / "experts.json").is_file():
        _say(f"{repo_id}: using the converted store {out}")
        return out
    _say(f"{repo_id}: converting {snapshot} ({experts} experts) into {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if experts == "source":
            from moetier.quant.convert import convert

            convert(snapshot, out, progress=progress, dense=policy)
        else:
            from moetier.loader.quantize import convert_quantized

            convert_quantized(snapshot, out, experts, progress=progress, dense=policy)
    except Exception:
        if (out / "experts.json").is_file():  # another process converted it meanwhile
            return out
        raise
    return out


def resolve(args: argparse.Namespace, verb: str) -> None:
    """Replace a Hub id in `args` (the verb's checkpoint or store argument) by a local path."""
    name = VERBS[verb]
    value = getattr(args, name, None)
    if not isinstance(value, str) or not is_hub_id(value):
        return
    if verb == "convert":
        # the destination first: a download of hundreds of GB then refused would waste hours
        from moetier.quant.convert import check_destination, work_path

        out = Path(args.out_dir).absolute()
        check_destination(value, out, args.force, resuming=work_path(out).exists())
        setattr(args, name, str(download(value, args.revision)))
    else:
        progress = sys.stderr.isatty()
        dense = getattr(args, "convert_dense", None)
        path = converted(value, args.revision, args.convert_experts, progress, dense)
        setattr(args, name, str(path))
        if getattr(args, "model_name", "unset") is None:
            args.model_name = value  # `serve` reports the Hub id as its model


def _say(message: str) -> None:
    print(f"moetier: {message}", file=sys.stderr, flush=True)


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
