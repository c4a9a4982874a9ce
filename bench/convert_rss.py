"""Peak memory of `moetier convert` on a ≈3 GB bf16 checkpoint (random weights, qwen3_moe).

Writes the checkpoint shard by shard into a temporary directory (never more than one shard in
memory), converts it with `python -m moetier convert` in a child process per run, and reports the
child's peak RSS (VmHWM of /proc/PID/status, the high-water mark of its own address space) and
its peak anonymous and file-backed memory (RssAnon, RssFile, sampled every 20 ms): file-backed
pages of memory-mapped inputs count in RSS but are dropped by the kernel under pressure,
anonymous ones are not. `wait4`'s maxrss is printed too, but Linux carries the forking parent's
RSS into it across exec (signal->maxrss), so it overstates the child by up to this script's own
size. One JSON line per conversion.

    python bench/convert_rss.py                      # bf16 store, then q2s round-to-nearest
    python bench/convert_rss.py --runs source --size-gb 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

SHARD_BYTES = 512 * 2**20


def model_config(size_gb: float) -> dict:
    """A qwen3_moe config (Qwen3-30B-A3B-like widths) whose bf16 weights take about size_gb."""
    hidden, inter, experts, vocab = 2048, 768, 64, 32000
    per_layer = experts * 3 * hidden * inter + 4 * hidden * hidden + hidden * experts
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
    }


def checkpoint_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint names and shapes as Hugging Face stores Qwen3-MoE (one tensor per expert)."""
    h, i, e = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (config["head_dim"],)),
            (p + "self_attn.k_norm.weight", (config["head_dim"],)),
            (p + "mlp.gate.weight", (e, h)),
        ]
        for x in range(e):
            out += [
                (p + f"mlp.experts.{x}.gate_proj.weight", (i, h)),
                (p + f"mlp.experts.{x}.up_proj.weight", (i, h)),
                (p + f"mlp.experts.{x}.down_proj.weight", (h, i)),
            ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (config["vocab_size"], h))]
    return out


def write_checkpoint(path: Path, size_gb: float) -> tuple[int, int]:
    """Random bf16 shards of at most SHARD_BYTES; returns (total bytes, largest tensor bytes)."""
    from safetensors.torch import save_file

    config = model_config(size_gb)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = largest = 0
    names: list[str] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
        shard, shard_bytes = {}, 0

    for key, shape in checkpoint_tensors(config):
        nbytes = 2 * math.prod(shape)
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
        if len(shape) == 1:
            shard[key] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            shard[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard_bytes += nbytes
        total += nbytes
        largest = max(largest, nbytes)
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total, largest


def measure(cmd: list[str]) -> dict:
    """Run cmd; its peak RSS (VmHWM), sampled peak RssAnon / RssFile and wait4 maxrss, in MiB."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peaks = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]))
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    stdout = proc.stdout.read() if proc.stdout else b""
    stderr = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    sampler.join()
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr.decode()[-3000:]}")
    return {
        "peak_rss_mib": round(peaks["VmHWM"] / 1024, 1),
        "peak_rss_anon_mib": round(peaks["RssAnon"] / 1024, 1),
        "peak_rss_file_mib": round(peaks["RssFile"] / 1024, 1),
        "wait4_maxrss_mib": round(usage.ru_maxrss / 1024, 1),
        "wall_s": round(time.perf_counter() - start, 1),
        "output": [line.strip() for line in stdout.decode().strip().splitlines()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=3.0)
    parser.add_argument("--runs", default="source,q2s", help="--experts values to convert with")
    parser.add_argument("--tmp", default=None, help="parent of the temporary directory")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    root = Path(tempfile.mkdtemp(prefix="convert-rss-", dir=args.tmp))
    try:
        src = root / "hf"
        src.mkdir()
        t0 = time.perf_counter()
        total, largest = write_checkpoint(src, args.size_gb)
        write_s = time.perf_counter() - t0
        ceiling = 1.5 * 2**30 + largest
        for experts in args.runs.split(","):
            dst = root / f"store-{experts}"
            cmd = [sys.executable, "-m", "moetier", "convert", str(src), str(dst)]
            cmd += ["--experts", experts]
            result = measure(cmd)
            shutil.rmtree(dst)
            print(
                json.dumps(
                    {
                        "bench": "convert_rss",
                        "experts": experts,
                        "checkpoint_bytes": total,
                        "largest_tensor_bytes": largest,
                        "checkpoint_write_s": round(write_s, 1),
                        **result,
                        "ceiling_mib": round(ceiling / 2**20, 1),
                        "within_ceiling": result["peak_rss_mib"] * 2**20 < ceiling,
                        "commit": commit,
                        "host": platform.node(),
                        "cpus": os.cpu_count(),
                        "torch": torch.__version__,
                    }
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
