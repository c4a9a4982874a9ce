"""Store integrity (issue #48): `moetier verify` checks the index and every blob's crc32 and names
a bad blob by layer, expert, plane, file and offset; the tiers verify a blob the first time they
read it, so a corrupted blob raises instead of being computed with, and the server answers an
error, not text, for a request that needs it (`--no-verify` serves the bad bytes, which shows it
is the check that refuses). The reference is zlib's crc32 of the bytes the converter wrote."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from uvicorn_thread import serving  # noqa: E402

from moetier.cli.main import main  # noqa: E402
from moetier.quant.store import DENSE_FILE, EXPERTS_FILE, INDEX_FILE, Store  # noqa: E402
from moetier.quant.verify import CorruptBlob, FirstReadCheck, verify_store  # noqa: E402
from moetier.residency.disk import DiskReader  # noqa: E402
from moetier.residency.host_tier import HostTier  # noqa: E402
from moetier.residency.slot_pool import SlotPool  # noqa: E402


@pytest.fixture
def store_copy(tiny, tmp_path) -> Path:
    path = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe"), path)
    return path


def entry_of(path: Path, layer: int, expert: int, plane: str = "base") -> dict:
    index = json.loads((path / INDEX_FILE).read_text())
    return next(
        b for b in index["blobs"] if (b["layer"], b["expert"], b["plane"]) == (layer, expert, plane)
    )


def flip_byte(path: Path, offset: int) -> None:
    with open(path / EXPERTS_FILE, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x20]))


def corrupt(path: Path, layer: int, expert: int, at: int = 77) -> dict:
    """Flip one byte `at` bytes into the blob; returns its index entry."""
    entry = entry_of(path, layer, expert)
    flip_byte(path, entry["offset"] + at)
    return entry


def names(message: str, path: Path, entry: dict) -> bool:
    return (
        f"layer {entry['layer']}, expert {entry['expert']}, plane {entry['plane']}" in message
        and str(path / EXPERTS_FILE) in message
        and f"offset {entry['offset']}" in message
    )


def test_index_checksums_are_zlib_crc32_of_the_bytes(store_copy):
    data = (store_copy / EXPERTS_FILE).read_bytes()
    index = json.loads((store_copy / INDEX_FILE).read_text())
    for b in index["blobs"]:
        assert zlib.crc32(data[b["offset"] : b["offset"] + b["bytes"]]) == b["crc32"]


def test_verify_command_passes_a_sound_store_and_names_a_flipped_byte(store_copy, capsys):
    assert main(["verify", str(store_copy)]) == 0
    assert "ok" in capsys.readouterr().out
    layer = Store(store_copy).moe_layers[-1]
    entry = corrupt(store_copy, layer, 3)
    assert main(["verify", str(store_copy)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and names(out[0], store_copy, entry), out


def test_verify_reports_index_problems(store_copy):
    index = json.loads((store_copy / INDEX_FILE).read_text())
    index["blobs"] = [b for b in index["blobs"] if (b["layer"], b["expert"]) != (0, 1)]
    first = next(b for b in index["blobs"] if b["offset"] > 0)
    first["offset"] += 8  # unaligned, and now past its bytes: its checksum fails too
    (store_copy / INDEX_FILE).write_text(json.dumps(index))
    report = verify_store(store_copy)
    text = "\n".join(report.problems)
    assert "layer 0, plane base: no blob for experts 1" in text
    assert "not 4096-byte aligned" in text
    assert "crc32" in text and not report.ok


def test_verify_reports_a_truncated_experts_file(store_copy):
    size = (store_copy / EXPERTS_FILE).stat().st_size
    with open(store_copy / EXPERTS_FILE, "r+b") as f:
        f.truncate(size - 4096)
    report = verify_store(store_copy)
    assert not report.ok and "truncated" in report.problems[0]


def test_a_damaged_dense_header_is_reported_and_refused_in_one_line(store_copy, capsys):
    """Its length field overwritten (a length of exabytes): verify reports the header instead of
    asking for that many bytes (a MemoryError), generate and plan refuse it in one line before
    any weight loads (safetensors' error was a traceback); an offset changed in the header's
    JSON is what safetensors itself refuses, reported by both too. (verify also names the
    checksum that no longer matches.)"""
    with open(store_copy / DENSE_FILE, "r+b") as f:
        f.seek(5)
        f.write(b"\xff\xff")
    dense = store_copy / DENSE_FILE
    size = dense.stat().st_size
    (length,) = struct.unpack("<Q", dense.read_bytes()[:8])
    assert length > 2**55
    assert main(["verify", str(store_copy)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == (
        f"{dense}: unreadable safetensors header (its length field says {length} bytes, the "
        f"file has {size})"
    )
    assert len(out) == 2 and out[1].startswith("corrupted dense.safetensors: ")  # its checksum
    advice = f"run `moetier verify {store_copy}`; convert the model again or restore the file"
    for argv in (
        ["generate", "--prompt", "hi", "--device", "cpu"],
        ["plan", "--gpu-memory", "1GiB"],
    ):
        assert main([argv[0], str(store_copy), *argv[1:]]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"moetier {argv[0]}: error: {out[0]}: {advice}"]

    raw = bytearray(dense.read_bytes())
    raw[5:7] = b"\0\0"  # the length as it was (zero: the header is under 2**40 bytes)
    first = raw.index(b'"data_offsets":[0,')
    raw[first : first + 18] = b'"data_offsets":[8,'
    dense.write_bytes(bytes(raw))
    assert main(["verify", str(store_copy)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert "safetensors cannot read it" in out[0] and "invalid offset" in out[0]
    assert len(out) == 2 and out[1].startswith("corrupted dense.safetensors: ")
    assert main(["generate", str(store_copy), "--prompt", "hi", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"moetier generate: error: {out[0]}: {advice}"
    ]


def overwrite_near_the_end(path: Path, nbytes: int = 100, before_end: int = 300) -> int:
    """`nbytes` bytes changed `before_end` bytes before the end of `path`; returns where."""
    at = path.stat().st_size - before_end
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(nbytes)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in old))
    return at


def test_the_index_records_dense_checksums_per_chunk(store_copy):
    from moetier.quant.store import FILE_CHUNK, file_record

    dense = store_copy / DENSE_FILE
    data = dense.read_bytes()
    record = json.loads((store_copy / INDEX_FILE).read_text())["files"][DENSE_FILE]
    assert record == {"bytes": len(data), "chunk_bytes": FILE_CHUNK, "crc32": [zlib.crc32(data)]}
    small = file_record(dense, 4096)
    assert small["crc32"] == [zlib.crc32(data[at : at + 4096]) for at in range(0, len(data), 4096)]


def test_dense_corruption_is_found_by_verify_and_refused_at_load(store_copy, capsys):
    """100 bytes overwritten near the end of dense.safetensors (inside a tensor: the header
    still reads) went unnoticed: verify said ok and generate ran. Now verify names the damaged
    range, the load refuses it in one line, and --no-verify loads the bytes as they are."""
    index = json.loads((store_copy / INDEX_FILE).read_text())
    at = overwrite_near_the_end(store_copy / DENSE_FILE)
    assert main(["verify", str(store_copy)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    size = index["files"][DENSE_FILE]["bytes"]
    assert len(out) == 1 and out[0].startswith(
        f"corrupted dense.safetensors: file {store_copy / DENSE_FILE}, bytes 0 to {size}: crc32 "
    )
    assert out[0].endswith(
        f"Run `moetier verify {store_copy}`; convert the model again or restore the file"
    )
    argv = ["generate", str(store_copy), "--prompt", "hi", "--max-new-tokens", "2"]
    assert main([*argv, "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"moetier generate: error: {out[0]}"]
    assert main([*argv, "--device", "cpu", "--no-verify"]) == 0
    capsys.readouterr()

    # recorded per 4 KiB instead: only the chunk holding the damage is named
    from moetier.quant.store import file_record

    overwrite_near_the_end(store_copy / DENSE_FILE)  # (undone: the bytes are as converted)
    index["files"][DENSE_FILE] = file_record(store_copy / DENSE_FILE, 4096)
    (store_copy / INDEX_FILE).write_text(json.dumps(index))
    assert verify_store(store_copy).ok
    overwrite_near_the_end(store_copy / DENSE_FILE)
    problems = verify_store(store_copy).problems
    begin = at // 4096 * 4096
    assert len(problems) == 1 and f"bytes {begin} to {min(begin + 4096, size)}:" in problems[0]


def test_a_dense_file_of_another_size_or_a_malformed_record_is_named(store_copy):
    from moetier.quant.verify import check_files

    dense = store_copy / DENSE_FILE
    size = dense.stat().st_size
    with open(dense, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(ValueError) as err:
        check_files(store_copy)
    assert str(err.value) == (
        f"{dense} is {size + 10} bytes, the index says {size}: run `moetier verify "
        f"{store_copy}`; convert the model again or restore the file"
    )
    with open(dense, "r+b") as f:  # (safetensors itself refuses the bytes past the tensors)
        f.truncate(size)
    assert verify_store(store_copy).ok
    index = json.loads((store_copy / INDEX_FILE).read_text())
    index["files"][DENSE_FILE]["crc32"] = []
    (store_copy / INDEX_FILE).write_text(json.dumps(index))
    assert verify_store(store_copy).problems == [
        "the index's checksums of dense.safetensors are malformed: convert the model again"
    ]


def test_a_store_without_dense_checksums_says_it_cannot_check_them(store_copy, capsys):
    """A store converted before the index recorded them: verify says dense.safetensors is not
    checked (not "ok" for it) and exits 0; it loads as before."""
    index = json.loads((store_copy / INDEX_FILE).read_text())
    del index["files"]
    (store_copy / INDEX_FILE).write_text(json.dumps(index))
    overwrite_near_the_end(store_copy / DENSE_FILE)  # what cannot be found without a checksum
    assert main(["verify", str(store_copy)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == (
        f"{store_copy / DENSE_FILE}: not checked: the index has no checksum of it (a store "
        "converted before moetier recorded one); convert the model again to have it checked"
    )
    assert out[1].startswith(f"{store_copy}: index and ")
    assert out[1].endswith("; dense.safetensors not checked (no checksum)")
    assert not out[1].startswith(f"{store_copy}: ok")
    assert main(["generate", str(store_copy), "--prompt", "hi", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0  # fmt: skip


def test_first_read_check_in_the_gpu_tier_mmap_and_direct(store_copy):
    layer = Store(store_copy).moe_layers[0]
    entry = corrupt(store_copy, layer, 2)
    store = Store(store_copy)
    for disk in (None, DiskReader.for_store(store, direct=False)):
        check = FirstReadCheck(store)
        pool = SlotPool.for_budget(store, "cpu", disk=disk, check=check)
        table = pool.ensure(layer, [0, 1])  # sound blobs load
        assert (layer, 0, "base") in check and int(table[1]) >= 0
        for _ in range(2):  # and a bad one fails every time: it is never left resident
            with pytest.raises(CorruptBlob) as err:
                pool.ensure(layer, [1, 2, 3])
            assert names(str(err.value), store_copy, entry)
            assert pool.slot_of((layer, 2, "base")) is None
            assert pool.slot_of((layer, 3, "base")) is None
        free = pool.capacity - len(pool.resident())
        assert free == pool.capacity - 2  # the failed batch's slots are free again
        # without the check, the flipped byte would have been computed with
        unchecked = SlotPool.for_budget(store, "cpu", disk=disk)
        slot = int(unchecked.ensure(layer, [2])[2])
        got = unchecked.pool[slot, : entry["bytes"]]
        assert zlib.crc32(got.numpy().tobytes()) != entry["crc32"]
        if disk is not None:
            disk.close()


def test_first_read_check_in_the_host_tier(store_copy):
    layer = Store(store_copy).moe_layers[-1]
    entry = corrupt(store_copy, layer, 5, at=1)
    store = Store(store_copy)
    with pytest.raises(CorruptBlob) as err:
        HostTier.for_budget(store, 1 << 30, check=FirstReadCheck(store))
    assert names(str(err.value), store_copy, entry)
    host = HostTier.for_budget(store, 1 << 30)  # unchecked, it holds the bad bytes
    assert (
        zlib.crc32(host.row((layer, 5, "base"))[: entry["bytes"]].numpy().tobytes())
        != (entry["crc32"])
    )


def test_first_read_check_verifies_each_blob_once(store_copy):
    store = Store(store_copy)
    check = FirstReadCheck(store)
    keys = sorted(store.blobs)[:4]
    check.check([(k, store.blob(*k)) for k in keys])
    checked = check.bytes
    assert checked == sum(store.blobs[k].nbytes for k in keys)
    check.check([(k, store.blob(*k)) for k in keys])
    assert check.bytes == checked  # already verified: not read again
    wrong = torch.zeros_like(store.blob(*keys[0]))
    check.check([(keys[0], wrong)])  # verified before: the first read is the one checked


def chat(url: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_server_refuses_to_answer_from_a_corrupted_blob(store_copy):
    from moetier.config import EngineConfig
    from moetier.engine.async_engine import AsyncEngine
    from moetier.engine.engine import Engine
    from moetier.engine.sampler import SamplingParams
    from moetier.loader.load import load_model
    from moetier.server.app import create_app

    store = Store(store_copy)
    layer = store.moe_layers[0]
    entries = [corrupt(store_copy, layer, x) for x in range(store.model_config.num_experts)]
    for verify in (True, False):

        def build(verify: bool = verify) -> AsyncEngine:
            config = EngineConfig(device="cpu", verify=verify)
            return AsyncEngine(Engine(load_model(store_copy, config)))

        app = create_app(build, "m", SamplingParams(temperature=0))
        with serving(app) as url:
            for _ in range(60):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
                time.sleep(0.5)
            first, again = chat(url), chat(url)
        if verify:
            for response in (first, again):
                assert response.status_code >= 500, response.text
                message = response.json()["error"]["message"]
                assert "corrupted expert blob" in message
                assert any(names(message, store_copy, e) for e in entries), message
        else:
            assert first.status_code == 200 and first.json()["choices"][0]["message"]


@pytest.mark.gpu
def test_first_read_check_on_cuda_slots_prefetch_and_pinned_host_tier(store_copy):
    """On the GPU: a prefetch on the copy stream and a blocking miss both refuse the bad blob
    and leave no slot for it; a pinned host tier refuses it at fill; sound blobs arrive intact."""
    layer = Store(store_copy).moe_layers[0]
    entry = corrupt(store_copy, layer, 4)
    store = Store(store_copy)
    pool = SlotPool.for_budget(store, "cuda", check=FirstReadCheck(store))
    with pytest.raises(CorruptBlob) as err:
        pool.prefetch([(layer, 3, "base"), (layer, 4, "base")])
    assert names(str(err.value), store_copy, entry)
    assert pool.slot_of((layer, 4, "base")) is None
    with pytest.raises(CorruptBlob):
        pool.ensure(layer, [4])
    slot = int(pool.ensure(layer, [3])[3])
    torch.cuda.synchronize()
    good = entry_of(store_copy, layer, 3)
    got = pool.pool[slot, : good["bytes"]].cpu().numpy().tobytes()
    assert zlib.crc32(got) == good["crc32"]
    with pytest.raises(CorruptBlob):
        HostTier.for_budget(store, 1 << 30, pinned=True, check=FirstReadCheck(store))
