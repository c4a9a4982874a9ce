"""`moetier convert HF_DIR OUT_DIR [--experts q2s --calibration TEXT --delta q2 --override ...]`."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetier.quant.store import Store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("out_dir", help="where to write the moetier store")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it holds a moetier store or is empty (any other folder, a file, "
        "or the checkpoint's own folder is refused)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a folder with the tokenizer (and chat template) files to put in the store, for a "
        "checkpoint that has none (it is refused without them) or to replace its own",
    )
    parser.add_argument(
        "--experts",
        choices=("source", "q2s", "int2", "affine2", "nvfp4", "mxfp4", "nested"),
        default="source",
        help="routed expert format: the checkpoint's (its dtype; FP8 dequantised; an NVFP4/MXFP4 "
        "checkpoint's own codes); q2s 2-bit; the 2-bit baselines int2 (naive {-2,-1,0,1}*absmax/2) "
        "and affine2 (asymmetric, HQQ zero); NVFP4/MXFP4; or nested (FP4 split into a 2-bit base "
        "plane and a 2-bit delta plane; from an FP4 checkpoint, its own codes) (default: source)",
    )
    parser.add_argument(
        "--delta",
        choices=("none", "nvfp4", "q2", "nested"),
        default="none",
        help="add a delta plane holding W - decode(base), coded as NVFP4 or as 2-bit q2s g16, "
        "applied at run time where the engine's --delta says; nested: FP4 weights split into a "
        "2-bit base plane and the 2 low bits as the delta plane (same as --experts nested) "
        "(default: none)",
    )
    parser.add_argument(
        "--group",
        type=int,
        default=32,
        help="group size (weights per scale) of gate/up for q2s, int2, affine2 (default: 32)",
    )
    parser.add_argument(
        "--down-group",
        type=int,
        default=None,
        help="group size of down_proj, the more sensitive matrix (default: 16 for q2s, else "
        "--group)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="[layers=L:][gate_up=|down=]FORMAT",
        help="a different format for some matrices or layers; repeatable, later ones win. "
        "FORMAT: q2s-gN, int2-gN, affine2-gN, nvfp4 or mxfp4; L: layer numbers as in the "
        "checkpoint (layers.N), ranges and commas. E.g. --override down=q2s-g16 --override "
        "'layers=0-1:nvfp4' --override 'layers=3,5:down=int2-g16'",
    )
    parser.add_argument(
        "--dense",
        default="bf16",
        metavar="FORMAT",
        help="format of the dense weights (attention, shared experts, dense MLPs, lm_head): bf16 "
        "(as the checkpoint has them, FP8 dequantised), fp8 (E4M3, 128x128 tile scales; an FP8 "
        "checkpoint's own tensors kept bit for bit), int4 / int4-gN (weight-only, group N, "
        "default 128) or nvfp4; embeddings, norms, routers and biases stay as they are; auto: "
        "the largest of bf16 > fp8 > int4 > nvfp4 that leaves at least one token's routed "
        "experts in GPU slots under --gpu-memory (`moetier plan --dense auto`) (default: bf16)",
    )
    for flag, what in (
        ("--gpu-memory", "GPU budget, e.g. 24GiB"),
        ("--host-memory", "pinned host RAM budget (default: 0)"),
    ):
        parser.add_argument(flag, help=f"with --dense auto: the {what}, as `moetier plan`")
    parser.add_argument(
        "--max-context", type=int, default=4096, help="with --dense auto: KV cache tokens per row"
    )
    parser.add_argument(
        "--embeddings",
        choices=("gpu", "host"),
        default="gpu",
        help="with --dense auto: where the embedding table will live (as generate/serve)",
    )
    parser.add_argument(
        "--dense-override",
        action="append",
        default=[],
        metavar="CLASS=FORMAT",
        help="another dense format for one class (attention, shared, mlp, lm_head); repeatable, "
        "e.g. --dense int4 --dense-override lm_head=fp8",
    )
    parser.add_argument(
        "--calibration",
        help="text file or folder of .txt: q2s experts rounded with statistics of this text, "
        "carried through the model one layer at a time (without it q2s rounds to nearest)",
    )
    parser.add_argument(
        "--calibration-tokens",
        type=_at_least(1),
        default=65536,
        help="calibration tokens carried through the model, layer by layer (default: 65536)",
    )
    parser.add_argument(
        "--calibration-mode",
        choices=("gptq", "diag"),
        default="gptq",
        help="gptq: GPTQ rounding on each expert's routing-weighted Hessians (one layer's at a "
        "time); diag: per-input-channel mean x^2 (llama.cpp's imatrix) weighting the rounding "
        "error, far less memory and time (default: gptq)",
    )
    parser.add_argument(
        "--calibration-target",
        choices=("quantized", "expert"),
        default="quantized",
        help="gptq: what each expert matrix is fitted to on the quantized model's inputs: its "
        "own float weights' output (quantized), or for down the float expert's output on the "
        "same inputs, making up for gate_up's error (expert) (default: quantized)",
    )
    parser.add_argument(
        "--calibration-refine",
        type=_at_least(0),
        default=0,
        metavar="N",
        help="gptq: N rounds of GPTQ again with the refitted group scales held, then the scales "
        "refitted to the new codes; each row keeps the pair with the least output error "
        "(default: 0)",
    )


# flags that only --dense auto reads, and those that only --calibration reads
DENSE_AUTO_FLAGS = ("gpu_memory", "host_memory", "max_context", "embeddings")
CALIBRATION_FLAGS = (
    "calibration_tokens",
    "calibration_mode",
    "calibration_target",
    "calibration_refine",
)
GROUPED_EXPERTS = ("q2s", "int2", "affine2")  # the formats --group and --down-group size


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ValueError for flags that would do nothing (cli/main.py calls it once they are parsed):
    a flag differing from its default where the conversion asked for never reads it, as
    --group with --experts source, --calibration-mode without --calibration or --gpu-memory
    without --dense auto; and counts out of range."""

    def given(dest: str) -> bool:
        return getattr(args, dest) != parser.get_default(dest)

    def flags(dests: tuple[str, ...]) -> str:
        return ", ".join("--" + d.replace("_", "-") for d in dests if given(d))

    grouped = flags(("group", "down_group"))
    if grouped and args.experts not in GROUPED_EXPERTS:
        raise ValueError(
            f"{grouped}: group sizes of --experts {', '.join(GROUPED_EXPERTS)}; --experts "
            f"{args.experts} has none to set (FP4 formats have fixed blocks; source keeps the "
            "checkpoint's weights)"
        )
    for flag, value in (("--group", args.group), ("--down-group", args.down_group)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: give a group size of 1 or more, e.g. 32")
    calibration = flags(CALIBRATION_FLAGS)
    if calibration and args.calibration is None:
        raise ValueError(
            f"{calibration} set how --calibration TEXT rounds q2s experts; without "
            "--calibration there is no calibration (q2s rounds to nearest): add it or drop them"
        )
    if args.calibration_mode == "diag" and given("calibration_target"):
        raise ValueError(
            "--calibration-target sets what GPTQ fits (--calibration-mode gptq); diag weights "
            "the rounding error by input importance and has no target: drop one of them"
        )
    if args.calibration_tokens < 1 or args.calibration_refine < 0:
        raise ValueError(
            "--calibration-tokens must be 1 or more and --calibration-refine 0 or more"
        )
    auto = flags(DENSE_AUTO_FLAGS)
    if auto and args.dense != "auto":
        raise ValueError(
            f"{auto}: what --dense auto chooses the dense format for; with --dense {args.dense} "
            "they do nothing: drop them, or give --dense auto"
        )
    if args.max_context < 1:
        raise ValueError(f"--max-context {args.max_context}: give 1 or more")


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number `low` or more (a negative token count crashed the
    calibration deep inside; 0 read as too little text)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number, {low} or more")
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    """Convert, holding the destination's lock; SIGINT and SIGTERM stop it cleanly, keeping the
    work folder that the same command resumes (quant/work_folder.py)."""
    from moetier.quant.sources import ConvertError
    from moetier.quant.store import tokenizer_files
    from moetier.quant.work_folder import STOP_SAID, DestinationLock

    if not tokenizer_files(Path(args.hf_dir)) and args.tokenizer is None:
        if (Path(args.hf_dir) / "config.json").is_file():
            raise ConvertError(
                f"{args.hf_dir} has no tokenizer files (tokenizer.json, tokenizer.model, "
                "*.tiktoken or vocab.json): a store without them cannot generate. Pass "
                "--tokenizer PATH naming a folder that has them (the original model's)"
            )
    stopped: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopped.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)  # the converter says which

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with DestinationLock(Path(args.out_dir)):
            return _convert(args)
    except KeyboardInterrupt as err:
        signum = stopped[0] if stopped else signal.SIGINT
        if not getattr(err, STOP_SAID, False):  # else the converter said it, naming its folder
            print(
                f"moetier convert: stopped by {signal.Signals(signum).name}; run the same "
                "command again to resume: what is written is kept",
                file=sys.stderr,
            )
        return 128 + signum
    except OSError as err:
        if getattr(err, STOP_SAID, False):
            return 1
        if isinstance(err, FileNotFoundError):
            raise
        print(
            f"moetier convert: error: {err}; what is written is kept: run the same command "
            "again to resume once the cause is fixed",
            file=sys.stderr,
        )
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _convert(args: argparse.Namespace) -> int:
    from moetier.quant.convert import convert
    from moetier.quant.dense_formats import DensePolicy
    from moetier.quant.store import Store

    start = time.perf_counter()
    progress = sys.stderr.isatty()
    if args.delta == "nested":  # the bit-plane split of FP4 weights: its own expert format
        if args.experts not in ("source", "nvfp4", "mxfp4", "nested"):
            raise ValueError(
                f"--delta nested splits FP4 weights bit-plane-wise; it does not apply to "
                f"--experts {args.experts} (use --delta nvfp4 or q2 for an additive delta)"
            )
        args.experts, args.delta = "nested", "none"
    if args.dense == "auto":
        from moetier.residency.dense_choice import choose_for_convert

        choice = choose_for_convert(args)
        print(choice.summary())
        args.dense = choice.kind
    dense = DensePolicy.parse(args.dense, args.dense_override)
    if args.experts != "source":
        from moetier.loader.quantize import convert_quantized

        out = convert_quantized(
            args.hf_dir,
            args.out_dir,
            args.experts,
            delta=None if args.delta == "none" else args.delta,
            calibration=args.calibration,
            calibration_tokens=args.calibration_tokens,
            calibration_mode=args.calibration_mode,
            calibration_target=args.calibration_target,
            calibration_refine=args.calibration_refine,
            group=args.group,
            down_group=args.down_group,
            overrides=args.override,
            force=args.force,
            progress=progress,
            dense=dense,
            tokenizer=args.tokenizer,
        )
    else:
        if args.calibration or args.delta != "none" or args.override:
            raise ValueError("--calibration, --delta and --override apply to low-bit --experts")
        out = convert(
            args.hf_dir,
            args.out_dir,
            force=args.force,
            progress=progress,
            dense=dense,
            tokenizer=args.tokenizer,
        )
    store = Store(out)
    cfg = store.model_config
    print(
        f"wrote {out}: {len(store.moe_layers)} MoE layers x {cfg.num_experts} experts; "
        f"{time.perf_counter() - start:.1f} s"
    )
    for line in bits_report(store, *store.dense_size):
        print("  " + line)
    print("  " + dense_report(store))
    return 0


def dense_report(store: Store) -> str:
    """The dense tensors' bytes per class (quant/dense_formats.py), with each class's formats."""
    formats: dict[str, set[str]] = {}
    for name, fmt in store.dense_formats.items():
        klass = store.index["dense"]["tensors"][name]["class"]
        formats.setdefault(klass, set()).add(fmt.name)
    by_class = store.dense_bytes_by_class()
    parts = []
    for klass, nbytes in sorted(by_class.items(), key=lambda kv: -kv[1]):
        how = f" ({', '.join(sorted(formats[klass]))})" if klass in formats else ""
        parts.append(f"{klass} {nbytes / 2**20:,.2f} MiB{how}")
    total = sum(by_class.values()) / 2**20
    return f"dense {total:,.2f} MiB: " + ", ".join(parts)


def bits_report(store: Store, dense_params: int, dense_bytes: int) -> list[str]:
    """Bits per weight of the experts (each plane, each format with its layers) and of the whole
    store, dense tensors included; blob bytes count alignment padding."""
    lines = []
    for plane in ("base", "delta"):
        if not store.has_plane(plane):
            continue
        layers_of: dict[str, list[int]] = {}
        for layer in store.moe_layers:
            layers_of.setdefault(store.blob_format(layer, plane).name, []).append(layer)
        per_layer = store.expert_params / len(store.moe_layers)
        parts = []
        for name, layers in layers_of.items():
            nbytes = sum(
                e.nbytes for e in store.blobs.values() if e.plane == plane and e.layer in layers
            )
            where = "" if len(layers_of) == 1 else f" (layers {_ranges(layers)})"
            parts.append(f"{name}{where} {8 * nbytes / (per_layer * len(layers)):.3f}")
        total = store.plane_bits_per_weight(plane)
        label = "experts " if plane == "base" else "delta plane, where applied: +"
        lines.append(f"{label}{total:.3f} bits per weight: {', '.join(parts)}")
    base_bytes = sum(e.nbytes for e in store.blobs.values() if e.plane == "base")
    params = store.expert_params + dense_params
    whole = f"whole store (dense {dense_params / 1e6:.1f} M weights included): "
    base_total = base_bytes + dense_bytes
    whole += f"{base_total / 2**20:.1f} MiB, {8 * base_total / params:.3f} bits per weight"
    if store.has_plane("delta"):
        all_bytes = store.expert_bytes + dense_bytes
        whole += f"; with the delta plane {all_bytes / 2**20:.1f} MiB, {8 * all_bytes / params:.3f}"
    lines.append(whole)
    return lines


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for layer in layers:
        if out and out[-1].split("-")[-1] == str(layer - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{layer}"
        else:
            out.append(str(layer))
    return ",".join(out)
