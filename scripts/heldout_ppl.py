"""Held-out perplexity of a moetier store on plain-text books, as the demo model's card reports it.

    python scripts/heldout_ppl.py [STORE] --books ../shared/data/gutenberg/eval --windows 400

Books are tokenised one by one with the store's tokenizer, joined with the eos token, cut into
windows of 512 tokens; every next-token prediction in a window is scored. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.loader.load import load_model


def book_tokens(tokenizer, folder: Path) -> list[int]:  # type: ignore[no-untyped-def]
    ids: list[int] = []
    for path in sorted(folder.glob("*.txt")):
        ids.extend(tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False))
        ids.append(tokenizer.eos_token_id)
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", nargs="?", default=str(DEFAULT_STORE))
    parser.add_argument("--books", default="../shared/data/gutenberg/eval")
    parser.add_argument("--windows", type=int, default=400)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    loaded = load_model(args.store, EngineConfig(device=args.device))
    ids = book_tokens(loaded.tokenizer, Path(args.books))
    n = min(args.windows, len(ids) // args.seq)
    windows = torch.tensor(ids[: n * args.seq]).view(n, args.seq)
    start, total = time.perf_counter(), 0.0
    with torch.inference_mode():
        for batch in windows.split(8):
            batch = batch.to(loaded.device)
            total += loaded.model(batch, labels=batch).loss.item() * len(batch)
    loss = total / n
    print(
        json.dumps(
            {
                "store": Path(args.store).name,
                "windows": n,
                "seq": args.seq,
                "tokens_scored": n * (args.seq - 1),
                "loss": round(loss, 4),
                "ppl": round(math.exp(loss), 2),
                "dtype": str(loaded.dtype),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
