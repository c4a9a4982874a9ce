"""q2s quantiser study on a trained MoE: quantise the routed experts, dequantise them back into
the transformers model ("fake quant"), and measure KL divergence against the original
(llama-perplexity protocol, `moetier.engine.quality`). One JSON line per variant.

    python bench/studies/q2s_fakequant.py --model ../shared/models/eval-moe-70m \
        --text ../shared/models/eval-moe-70m/kld_text.txt \
        --calibration ../shared/data/gutenberg/train --variants rtn,imatrix,gptq

Variants: naive (int2 {-2,-1,0,1}*absmax/2, fp16 scale), hqq (asymmetric affine 2-bit, HQQ
zero refinement, fp16 scale and zero; both from moetier.quant.baselines, the store formats
`--experts int2|affine2`), rtn (q2s, MSE scale search, no calibration), imatrix
(scale search weighted by the per-channel mean x^2), gptq (imatrix scales + Hessian error
feedback), gptq-ao (gptq visiting columns by decreasing importance, static group scales), each
at g32 (2.25 bpw + row scale),
g16 (suffix _g16), or gate_up at g32 and down_proj at g16 (suffix _g32d16). Calibration
activations are gathered from the unquantised model over 512-token chunks of the calibration
books, every token counted alike (the store converter, `moetier convert --experts q2s
--calibration`, also weighs each token by its routing weight, which measured better).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from moetier.engine.quality import chunks, compare
from moetier.quant.baselines import quantize_affine2, quantize_int2
from moetier.quant.q2s import quantize_q2s


def calibration_hessians(model, ids: torch.Tensor) -> dict[str, list[list[torch.Tensor]]]:  # type: ignore[no-untyped-def]
    """Per experts module: [H_gate_up[e], H_down[e]] = sum of x x^T over the tokens routed to e."""
    stats: dict[str, list[list[torch.Tensor]]] = {}
    hooks = []
    for name, module in model.named_modules():
        if not hasattr(module, "is_concatenated"):
            continue
        e_count, hid, inter = (
            module.gate_up_proj.shape[0],
            module.gate_up_proj.shape[2],
            module.down_proj.shape[2],
        )
        stats[name] = [
            [torch.zeros(hid, hid, dtype=torch.float64) for _ in range(e_count)],
            [torch.zeros(inter, inter, dtype=torch.float64) for _ in range(e_count)],
        ]

        def hook(mod, args, name=name):  # type: ignore[no-untyped-def]
            hidden, top_k_index = args[0], args[1]
            for e in torch.unique(top_k_index).tolist():
                tok = (top_k_index == e).any(dim=-1)
                x = hidden[tok].double()
                stats[name][0][e] += x.T @ x
                h = mod._apply_gate(torch.nn.functional.linear(hidden[tok], mod.gate_up_proj[e]))
                stats[name][1][e] += h.double().T @ h.double()

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.inference_mode():
        for batch in ids.split(8):
            model(batch)
    for h in hooks:
        h.remove()
    return stats


def quantise_model(model, stats, method: str, group: int, down_group: int) -> float:  # type: ignore[no-untyped-def]
    """Replace every routed expert by its q2s reconstruction; returns bits per expert weight."""
    bits = weights = 0.0
    for name, module in model.named_modules():
        if name not in stats:
            continue
        with torch.no_grad():
            for e in range(module.gate_up_proj.shape[0]):
                for param, hess, g in (
                    (module.gate_up_proj, stats[name][0][e], group),
                    (module.down_proj, stats[name][1][e], down_group),
                ):
                    w = param[e].float()
                    if method in ("naive", "hqq"):
                        # the store formats int2-gG / affine2-gG (moetier.quant.baselines)
                        b = quantize_int2(w, g) if method == "naive" else quantize_affine2(w, g)
                        param[e] = b.dequantize().to(param.dtype)
                        bits += b.bits_per_weight * w.numel()
                        weights += w.numel()
                        continue
                    if method == "rtn":
                        q = quantize_q2s(w, None, group=g)
                    elif method == "imatrix":
                        # diagonal H: importance-weighted scales, no cross-column error feedback
                        q = quantize_q2s(w, torch.diag(torch.diag(hess)), group=g)
                    else:
                        q = quantize_q2s(w, hess, group=g, act_order=method == "gptq-ao")
                    param[e] = q.dequantize().to(param.dtype)
                    bits += q.bits_per_weight * w.numel()
                    weights += w.numel()
    return bits / weights


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="../shared/models/eval-moe-70m")
    parser.add_argument("--text", default="../shared/models/eval-moe-70m/kld_text.txt")
    parser.add_argument("--calibration", default="../shared/data/gutenberg/train")
    parser.add_argument("--calibration-chunks", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=0, help="scored chunks (0 = all)")
    parser.add_argument("--variants", default="rtn,imatrix,gptq")
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    ref = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    text_ids = chunks(
        tok.encode(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False),
        512,
        args.chunks,
    )
    books = sorted(Path(args.calibration).glob("*.txt"))
    calib_text = "".join(p.read_text(encoding="utf-8")[:20000] for p in books)
    calib_ids = chunks(
        tok.encode(calib_text, add_special_tokens=False), 512, args.calibration_chunks
    )
    start = time.time()
    stats = calibration_hessians(ref, calib_ids)
    calib_s = time.time() - start
    # Reference log-probs once, replayed for every variant.
    ref_logits: dict[int, torch.Tensor] = {}

    def reference(batch: torch.Tensor) -> torch.Tensor:
        key = hash(batch.numpy().tobytes())
        if key not in ref_logits:
            with torch.inference_mode():
                ref_logits[key] = ref(batch).logits
        return ref_logits[key]

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    for variant in args.variants.split(","):
        # e.g. gptq, gptq_g16, gptq_g32d16 (gate_up at g32, down_proj at g16)
        method, _, g = variant.partition("_g")
        group_text, _, down_text = g.partition("d")
        group = int(group_text) if group_text else 32
        down_group = int(down_text) if down_text else group
        model = copy.deepcopy(ref)
        t0 = time.time()
        bpw = quantise_model(model, stats, method, group, down_group)
        quant_s = time.time() - t0
        report = compare(lambda b, m=model: m(b).logits, reference, text_ids)
        print(
            json.dumps(
                {
                    "variant": variant,
                    "experts_bpw": round(bpw, 4),
                    **{
                        k: round(v, 5) if isinstance(v, float) else v
                        for k, v in report.to_dict().items()
                    },
                    "calibration_tokens": calib_ids.numel(),
                    "calibration_s": round(calib_s, 1),
                    "quantise_s": round(quant_s, 1),
                    "commit": commit,
                    "host": platform.node(),
                    "torch": torch.__version__,
                }
            ),
            flush=True,
        )
        del model


if __name__ == "__main__":
    main()
