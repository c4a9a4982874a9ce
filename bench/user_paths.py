"""The paths a user runs against the benchmark's, on one store with the same flags: `moetier
bench --batch 1` (rows queued at once, random prompt ids), `moetier generate` (one request,
its speed line on stderr) and a streaming request to `moetier serve` (a real server on
loopback, the decode rate from the stream's arrival times and its usage: the first request
after ready, and a second one beside it). generate and serve read the same text prompt; the
bench reads random ids (with experts partly in host RAM the routing, hence the hit rate,
depends on the prompt). Each runs in its own
process, as a user runs it; one JSON line per path with its decode tok/s and its ratio to the
bench's (the issue's bound: within 10%).

  python bench/user_paths.py --layers 8
  python bench/user_paths.py --layers 8 --gpu-fraction 0.25
  python bench/user_paths.py --device cpu --layers 1 --new-tokens 8   # smoke (the tokenizer
  # has 4,096 ids: the tiny shape, 512, cannot read its text)
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit  # noqa: E402  (bench/ is on sys.path when run as a script)

from moetier.config import DEFAULT_STORE
from moetier.core.provenance import run_info
from moetier.quant.store import Store
from moetier.quant.synthetic import shape, write_synthetic_store

PROMPT = "The old lighthouse keeper climbed the stairs each evening and lit the lamp. " * 6
MOETIER = [sys.executable, "-m", "moetier"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed:\n{done.stderr[-3000:]}")
    return done


def bench_path(store: Path, flags: list[str], new: int) -> float:
    command = [*MOETIER, "bench", str(store), "--batch", "1", "--new-tokens", str(new)]
    out = _run([*command, "--json", *flags]).stdout
    record = json.loads(out.strip().splitlines()[-1])
    return float(record["decode_tok_s"])


def generate_path(store: Path, flags: list[str], new: int) -> float:
    command = [*MOETIER, "generate", str(store), "--prompt", PROMPT, "--temperature", "0"]
    err = _run([*command, "--max-new-tokens", str(new), *flags]).stderr
    found = re.search(r"decode ([0-9.]+) tok/s", err)
    if found is None:
        raise RuntimeError(f"no speed line from moetier generate:\n{err[-2000:]}")
    return float(found.group(1))


def serve_path(
    store: Path, flags: list[str], new: int, ready_s: float
) -> tuple[float, float, float]:
    """-> (decode tok/s of the first streamed completion after ready, of a second one with the
    same prompt, seconds until /health said ready)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.perf_counter()
    server = subprocess.Popen(
        [*MOETIER, "serve", str(store), "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"moetier serve exited:\n{server.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - began > ready_s:
                raise RuntimeError(f"moetier serve not ready after {ready_s} s")
            time.sleep(0.5)
        ready = time.perf_counter() - began
        body = {
            "prompt": PROMPT,
            "max_tokens": new,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        rates = []
        for _ in range(2):  # the first request after ready, then a second one
            arrivals, tokens = [], 0
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if event.get("choices") and event["choices"][0].get("text"):
                        arrivals.append(time.perf_counter())
            # tokens after the first text chunk, over the time to the last one
            rates.append((tokens - 1) / (arrivals[-1] - arrivals[0]))
        return rates[0], rates[1], ready
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpu-fraction", type=float, default=1.0)
    parser.add_argument("--paths", default="bench,generate,serve")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    flags = ["--device", args.device]
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        store = write_synthetic_store(
            Path(tmp) / "store", shape(args.shape, args.layers), "q2s", DEFAULT_STORE
        )
        if args.gpu_fraction < 1:
            blobs = sum(1 for k in Store(store).blobs if k[2] == "base")
            slots = max(1, round(args.gpu_fraction * blobs))
            flags += ["--expert-cache-slots", str(slots), "--host-memory", "1TiB"]
        common = {
            **run_info(),
            "case": "user-path",
            "shape": args.shape,
            "layers": args.layers,
            "gpu_fraction": args.gpu_fraction,
            "new_tokens": args.new_tokens,
            "flags": " ".join(flags),
        }
        reference = None
        for path in args.paths.split(","):
            extra: dict = {}
            if path == "bench":
                rate = bench_path(store, flags, args.new_tokens)
                reference = rate
            elif path == "generate":
                rate = generate_path(store, flags, args.new_tokens)
            else:
                rate, again, ready = serve_path(store, flags, args.new_tokens, args.ready_timeout)
                extra["ready_s"] = round(ready, 1)
                extra["second_request_tok_s"] = round(again, 1)
            ratio = round(rate / reference, 4) if reference else None
            emit({**common, "path": path, "decode_tok_s": round(rate, 1),
                  "ratio_to_bench": ratio, **extra})  # fmt: skip


if __name__ == "__main__":
    main()
