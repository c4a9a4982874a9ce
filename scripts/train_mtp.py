"""Train a multi-token-prediction (MTP) layer for a model that has none (eval-moe-70m), the main
model frozen, so that speculative decoding's acceptance can be measured on real text.

    PYTHONPATH=. python scripts/train_mtp.py ../shared/models/eval-moe-70m \\
        --text-dir ../shared/data/gutenberg/train --out ~/.cache/moetier/mtp/eval-70m.safetensors

The layer is DeepSeek's (moetier/models/mtp.py): enorm, hnorm, eh_proj, one decoder block of
the family with a dense MLP, the shared head's norm (the LM head is the main model's). At
position p it reads the main model's final hidden state and the embedding of token p + 1 and is
trained to predict token p + 2 (AdamW, cosine schedule): `--objective text` the text's own
token (cross-entropy), `--objective distill` the main model's distribution at p + 1 (soft
cross-entropy against it: the drafts are kept where they equal the model's own choice, so that
is what the layer should predict). Its block starts from a
copy of the main model's last attention and a fresh dense MLP whose output projection starts at
zero; eh_proj starts as the identity on the hidden half. The file holds the checkpoint's names
(`model.layers.{num_hidden_layers}.*`), which `--mtp-file` loads beside a store
(docs/serve.md). One JSON line at the end: steps, tokens, the first and last loss.

Defaults (256 steps of 8 x 256 tokens, 0.5 M tokens) take about 10 minutes on 2 CPU cores."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--text-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--objective", choices=("text", "distill"), default="text")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model.to(device)
    model.requires_grad_(False)
    config = model.config
    if config.model_type != "qwen3_moe":
        raise SystemExit(f"this script trains an MTP layer for qwen3_moe, not {config.model_type}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    need = args.steps * args.batch * (args.seq + 2)
    ids: list[int] = []
    for path in sorted(args.text_dir.glob("*.txt")):
        ids += tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        ids.append(int(config.eos_token_id or 0))
        if len(ids) >= 4 * need:
            break
    data = torch.tensor(ids)
    if len(data) < need:
        raise SystemExit(f"{args.text_dir} holds {len(data)} tokens; {need} are needed")

    hidden = config.hidden_size
    eps = config.rms_norm_eps
    layer = config.num_hidden_layers
    block_config = type(config)(**{**config.to_dict(), "mlp_only_layers": [layer]})
    block = qwen.Qwen3MoeDecoderLayer(block_config, layer)
    block.self_attn.load_state_dict(model.model.layers[-1].self_attn.state_dict())
    mtp = torch.nn.ModuleDict(
        {
            "enorm": qwen.Qwen3MoeRMSNorm(hidden, eps),
            "hnorm": qwen.Qwen3MoeRMSNorm(hidden, eps),
            "eh_proj": torch.nn.Linear(2 * hidden, hidden, bias=False),
            "block": block,
            "head_norm": qwen.Qwen3MoeRMSNorm(hidden, eps),
        }
    )
    with torch.no_grad():  # at first: the hidden state through the copied attention
        mtp["eh_proj"].weight.zero_()
        mtp["eh_proj"].weight[:, hidden:].copy_(torch.eye(hidden))
        block.mlp.down_proj.weight.zero_()
    mtp.to(device)
    mask = _causal(args.seq).to(device)
    rotary = model.model.rotary_emb
    optimizer = torch.optim.AdamW(mtp.parameters(), lr=args.lr, weight_decay=0.01)
    losses = []
    began = time.perf_counter()
    for step in tqdm(range(args.steps), desc="training the MTP layer"):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - args.seq - 2, (args.batch,))
        batch = torch.stack([data[s : s + args.seq + 2] for s in starts.tolist()]).to(device)
        with torch.no_grad():
            # the final norm's output at positions 0 .. seq (seq + 1: the teacher's last)
            full = model.model(batch[:, : args.seq + 1]).last_hidden_state
            h = full[:, : args.seq]
            embeds = model.model.embed_tokens(batch[:, 1 : args.seq + 1])
            teacher = None
            if args.objective == "distill":  # the model's own next-token distribution at p + 1
                teacher = model.lm_head(full[:, 1:]).softmax(dim=-1)
        positions = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)
        cos_sin = rotary(h, positions)
        x = mtp["eh_proj"](torch.cat([mtp["enorm"](embeds), mtp["hnorm"](h)], dim=-1))
        out = mtp["block"](x, position_embeddings=cos_sin, attention_mask=mask,
                           position_ids=positions)  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(mtp["head_norm"](out))
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 2:].reshape(-1))
        else:
            loss = -(teacher * logits.log_softmax(dim=-1)).sum(dim=-1).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))

    prefix = f"model.layers.{layer}."
    tensors = {
        f"{prefix}enorm.weight": mtp["enorm"].weight,
        f"{prefix}hnorm.weight": mtp["hnorm"].weight,
        f"{prefix}eh_proj.weight": mtp["eh_proj"].weight,
        f"{prefix}shared_head.norm.weight": mtp["head_norm"].weight,
    }
    tensors |= {f"{prefix}{k}": v for k, v in block.state_dict().items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"mtp_layers": "1", "trained_for": args.model.name}
    save_file({k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(args.out), metadata=meta)  # fmt: skip
    line = {"out": str(args.out), "objective": args.objective, "steps": args.steps,
            "tokens": args.steps * args.batch * args.seq,
            "first_loss": round(sum(losses[:8]) / len(losses[:8]), 4),
            "last_loss": round(sum(losses[-8:]) / len(losses[-8:]), 4),
            "seconds": round(time.perf_counter() - began, 1)}  # fmt: skip
    print(json.dumps(line))


def _causal(length: int) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 where a position may attend, -inf above the diagonal."""
    mask = torch.full((length, length), float("-inf")).triu(1)
    return mask[None, None]


if __name__ == "__main__":
    main()
