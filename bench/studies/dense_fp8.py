"""Dense FP8 study on a trained MoE (#52 item 5): which dense tensors cost the most KL divergence
in FP8 E4M3, and whether another scale layout or scale choice helps. The chosen tensors are
quantised by moetier's own dense formats (quant/dense_formats.py), dequantised back into the
transformers model ("fake quant") and scored against the original (llama-perplexity protocol,
`moetier.engine.quality`; fp32 on CPU). The routed experts stay as they are. One JSON line per
variant.

    python bench/studies/dense_fp8.py --model ../shared/models/eval-moe-70m \
        --text ../shared/models/eval-moe-70m/kld_text.txt --chunks 16

Variants (NAME[:WHICH], WHICH a comma list of q,k,v,o, default all four attention projections):
  fp8-b128x128   the store's default for bf16 sources before 2c2d2f3: one absmax/448 scale per
                 128x128 tile
  fp8            the store's default now (--dense fp8): per row and 128 columns, searched
  fp8-bNxK       one scale per N rows and K columns (fp8-b1x128: per row and 128 columns)
  fp8-row        one scale per output row (per-channel)
  fp8-...-mse    the same tiles, each tile's scale the best of 16 steps in [absmax/448,
                 2 absmax/448) by squared error (E4M3's error depends on where the values fall
                 between powers of two); fp8-mse alone: 128x128 tiles
  fp8-...-pow2   the scale rounded up to a power of two (UE8M0, as MXFP8)
  lm_head        also the (tied) output head in fp8 b128x128, as a separate matrix (the table
                 keeps its bf16 input embedding)
  bf16           nothing quantised (checks the pipeline: KLD 0)
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from moetier.core.provenance import run_info
from moetier.engine.quality import chunks, compare
from moetier.quant.dense_formats import DenseFormat, quantize_fp8_block
from moetier.quant.fp4 import E4M3_MAX

_PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def fp8_roundtrip(w: torch.Tensor, block: tuple[int, int], search: int = 1, pow2: bool = False):  # type: ignore[no-untyped-def]
    """w [N, K] -> its FP8 reconstruction with one scale per `block` tile; `search` candidate
    scales absmax/448 * 2^(j/search), j < search, the one with the least squared error kept."""
    w = w.float()
    n, k = w.shape
    bn, bk = min(block[0], n), min(block[1], k)
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    tiles = padded.view(rows, bn, cols, bk).permute(0, 2, 1, 3)  # [R, C, bn, bk]
    amax = tiles.abs().amax(dim=(2, 3), keepdim=True)
    base = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if pow2:
        base = torch.exp2(torch.ceil(torch.log2(base)))
    best, best_err = None, None
    for j in range(search):
        scale = base * 2 ** (j / search)
        q = (tiles / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
        err = (q - tiles).pow(2).sum(dim=(2, 3), keepdim=True)
        if best is None:
            best, best_err = q, err
        else:
            better = err < best_err
            best = torch.where(better, q, best)
            best_err = torch.where(better, err, best_err)
    assert best is not None
    return best.permute(0, 2, 1, 3).reshape(rows * bn, cols * bk)[:n, :k]


def _layout(name: str, k: int) -> tuple[tuple[int, int], int, bool]:
    """'fp8-b1x128', 'fp8-row', 'fp8-mse' (128x128), with '-mse' / '-pow2' suffixes -> (block,
    search steps, pow2)."""
    parts = name.split("-")
    if parts[0] != "fp8":
        raise ValueError(f"unknown variant {name!r}")
    block, search, pow2 = (128, 128), 1, False
    for part in parts[1:]:
        if part == "row":
            block = (1, k)
        elif part.startswith("b") and "x" in part:
            n, _, kk = part[1:].partition("x")
            block = (int(n), int(kk))
        elif part.startswith("mse"):
            search = int(part[3:] or 16)
        elif part == "pow2":
            pow2 = True
        else:
            raise ValueError(f"unknown variant {name!r}")
    return block, search, pow2


def quantise(model, variant: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Put the variant's reconstruction in place; returns relative squared error per projection."""
    name, _, which = variant.partition(":")
    projs = [_PROJ[c] for c in (which.split(",") if which else "qkvo")]
    errors: dict[str, list[float]] = {}
    with torch.no_grad():
        if name == "lm_head":
            head = model.lm_head
            w = head.weight.detach().clone()
            head.weight = torch.nn.Parameter(fp8_roundtrip(w, (128, 128)).to(w.dtype))
            name = "fp8-b128x128"
        if name == "bf16":
            return {}
        for mod_name, module in model.named_modules():
            leaf = mod_name.rsplit(".", 1)[-1]
            if leaf not in projs or ".self_attn" not in mod_name:
                continue
            w = module.weight.data
            if name == "fp8-b128x128":  # the store's quantiser before 2c2d2f3 (steps=1)
                fmt = DenseFormat("fp8", (128, 128))
                recon = fmt.dequantize(list(quantize_fp8_block(w, (128, 128), steps=1)))
            elif name == "fp8":  # the store's quantiser now (--dense fp8)
                fmt = DenseFormat.parse("fp8")
                recon = fmt.dequantize(fmt.quantize(w))
            else:
                recon = fp8_roundtrip(w, *_layout(name, w.shape[1]))
            rel = ((recon - w.float()).pow(2).sum() / w.float().pow(2).sum()).item()
            errors.setdefault(leaf, []).append(rel)
            module.weight.data = recon.to(w.dtype)
    return {k: sum(v) / len(v) for k, v in errors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="../shared/models/eval-moe-70m")
    parser.add_argument("--text", default="../shared/models/eval-moe-70m/kld_text.txt")
    parser.add_argument("--chunks", type=int, default=0, help="scored chunks (0 = all)")
    parser.add_argument(
        "--variants",
        default="bf16,fp8-b128x128,fp8-b128x128:q,fp8-b128x128:k,fp8-b128x128:v,"
        "fp8-b128x128:o,fp8-b1x128,fp8-row,fp8-mse,fp8-row-mse,fp8-pow2,lm_head",
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    ref = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    text_ids = chunks(
        tok.encode(Path(args.text).read_text(), add_special_tokens=False), 512, args.chunks
    )
    ref_logits: dict[int, torch.Tensor] = {}

    def reference(batch: torch.Tensor) -> torch.Tensor:
        key = hash(batch.numpy().tobytes())
        if key not in ref_logits:
            with torch.inference_mode():
                ref_logits[key] = ref(batch).logits
        return ref_logits[key]

    info = run_info()
    for variant in args.variants.split(","):
        model = copy.deepcopy(ref)
        if variant.startswith("lm_head"):
            model.config.tie_word_embeddings = False
        errors = quantise(model, variant)
        t0 = time.time()
        report = compare(lambda b, m=model: m(b).logits, reference, text_ids)
        line = {
            "variant": variant,
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in report.to_dict().items()},
            "rel_sq_error": {k: round(v, 7) for k, v in errors.items()},
            "seconds": round(time.time() - t0, 1),
            "commit": info.get("commit"),
        }
        print(json.dumps(line), flush=True)
        del model


if __name__ == "__main__":
    main()
