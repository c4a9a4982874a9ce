"""Train moetier's embedded demo model: a small Qwen3-MoE on public-domain books.

Two stages, so the GPU machine needs only token ids (the books stay here):

  # on any machine with ../shared/data: train the tokenizer, tokenize train and eval books
  python scripts/train_demo_model.py prepare --books ../shared/data/gutenberg --out .carry/demo

  # on the GPU: train from the token ids, write a HF checkpoint + training_report.json
  python scripts/train_demo_model.py train --data .carry/demo --out demo-hf --minutes 5

  # then: moetier convert demo-hf moetier/assets/demo-moe-10m  (and keep its README.md card)

On a lent GPU machine only 8 files come back from $OUT: tar the output folder there
(`tar -C $OUT -cf $OUT/demo-hf.tar demo-hf`) and unpack it here.

Everything is seeded; the same inputs give the same tokenizer and (up to GPU non-determinism)
the same model. The architecture is transformers' `qwen3_moe`, so every tool that knows Qwen3-MoE
(and moetier's HF oracle tests) understands it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}{{- '<|im_start|>system\\n' + m.content + "
    "'<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    intermediate_size=512,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.01,
    rope_theta=10000.0,
    eos_token_id=0,
    pad_token_id=0,
    bos_token_id=None,
)


def read_books(folder: Path) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))]


def prepare(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    books = Path(args.books)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = read_books(books / "train"), read_books(books / "eval")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab_size"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(train, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out / "tokenizer")
    eos = tok.token_to_id("<|endoftext|>")
    for name, texts in (("train", train), ("eval", held_out)):
        ids: list[int] = []
        for text in texts:
            ids.extend(tok.encode(text).ids)
            ids.append(eos)  # documents are separated by <|endoftext|>
        np.save(out / f"{name}.npy", np.asarray(ids, dtype=np.uint16))
        print(f"{name}: {len(texts)} books, {len(ids):,} tokens")


def evaluate(model, tokens: np.ndarray, seq: int, windows: int, device: str) -> float:  # type: ignore[no-untyped-def]
    import torch

    n = min(windows, (len(tokens) - 1) // seq)
    losses = []
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        for start in range(0, n, 16):
            idx = range(start, min(n, start + 16))
            batch = torch.from_numpy(
                np.stack([tokens[i * seq : i * seq + seq].astype(np.int64) for i in idx])
            ).to(device)
            losses.append(model(batch, labels=batch).loss.float().item() * len(idx))
    model.train()
    return sum(losses) / n


def train(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    data, out = Path(args.data), Path(args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train_ids = np.load(data / "train.npy")
    eval_ids = np.load(data / "eval.npy")
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    config = AutoConfig.for_model("qwen3_moe", **SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if device == "cuda":
        model.set_experts_implementation("grouped_mm")
    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda"
    )
    seq, batch = args.seq, args.batch
    budget = args.minutes * 60
    warmup = 100
    log = []
    start = time.time()
    step = 0
    est_steps = args.max_steps or 10**9
    while True:
        elapsed = time.time() - start
        if elapsed > budget or step >= est_steps:
            break
        # Cosine decay over the time budget (the step count is not known in advance).
        progress = min(1.0, elapsed / budget)
        lr = (
            args.lr
            * min(1.0, (step + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train_ids) - seq - 1, size=batch)
        x = torch.from_numpy(np.stack([train_ids[s : s + seq].astype(np.int64) for s in starts]))
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(x, labels=x, output_router_logits=True).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 200 == 0:
            entry = [step, round(time.time() - start, 1), loss.item()]
            log.append(entry)
            print(f"step {entry[0]}  {entry[1]:.0f}s  loss {entry[2]:.3f}", flush=True)
    held_loss = evaluate(model, eval_ids, seq, args.eval_windows, device)
    model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="10MB")
    tokenizer.save_pretrained(out)
    report = {
        "steps": step,
        "tokens_seen": step * batch * seq,
        "train_tokens": int(len(train_ids)),
        "heldout_tokens_scored": int(min(args.eval_windows, (len(eval_ids) - 1) // seq) * seq),
        "heldout_loss": held_loss,
        "heldout_ppl": math.exp(held_loss),
        "params": params,
        "minutes": round((time.time() - start) / 60, 2),
        "args": vars(args),
        "log": log,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "log"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("prepare", help="train the tokenizer and tokenize the books")
    p.add_argument("--books", default="../shared/data/gutenberg")
    p.add_argument("--out", default=".carry/demo")
    t = sub.add_parser("train", help="train the model from prepared token ids")
    t.add_argument("--data", default=".carry/demo")
    t.add_argument("--out", default="demo-hf")
    t.add_argument("--minutes", type=float, default=5.0)
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--eval-windows", type=int, default=400)
    t.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    prepare(args) if args.stage == "prepare" else train(args)


if __name__ == "__main__":
    main()
