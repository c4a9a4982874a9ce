"""The moetier store: what `moetier convert` writes and everything else reads.

    STORE/
      config.json, generation_config.json, tokenizer files, chat template   (copied)
      dense.safetensors   every tensor that is not a routed expert, under the HF module names
      experts.bin         one contiguous, 4 KiB-aligned blob per (layer, expert, plane)
      experts.json        the index: formats, and per blob layer, expert, plane, offset, bytes,
                          format, shape, crc32 checksum; under "dense" the quantized dense
                          weights (module name -> format, class, [N, K]; quant/dense_formats.py);
                          under "files" dense.safetensors' size and crc32 per FILE_CHUNK bytes
                          (stores written before it have none)

A blob holds all tensors of one expert for one plane ("base"; an optional "delta" plane after
all base blobs) back to back, each sub-tensor 256-byte aligned. Unquantized blobs use the
canonical layout below; the low-bit layouts are in core/layout.py and docs/formats.md:
  gate_up       [2*I, H]  rows 0..I-1 are the gate projection, rows I..2I-1 the up projection
  down          [H, I]
  gate_up_bias  [2*I]     (gpt-oss only; same split as gate_up)
  down_bias     [H]       (gpt-oss only)
so a GPU slot is just `blob bytes` and tensors are views into it.

Multi-token-prediction (MTP) layers the checkpoint carries are kept (quant/convert.py): their
routed experts are blobs of store layers num_hidden_layers + i, their other tensors are in
dense.safetensors under the checkpoint's names. `Store.blobs`, `dense_size` and everything that
sizes or runs the main model leave them out; `mtp_layers`, `mtp_blobs` and `mtp_dense` name them.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetier.config import ModelConfig, read_json
from moetier.core.layout import BlobFormat
from moetier.quant.dense_formats import DenseFormat, dense_class

STORE_VERSION = 1
BLOB_ALIGN = 4096
INDEX_FILE = "experts.json"
EXPERTS_FILE = "experts.bin"
DENSE_FILE = "dense.safetensors"
# The weights files beside experts.bin whose bytes the index checksums under "files" (the blobs
# carry their own): the crc32 of each FILE_CHUNK bytes, so that a check runs chunks side by side
# (quant/verify.py) and names the damaged range
CHECKSUMMED_FILES = (DENSE_FILE,)
FILE_CHUNK = 64 << 20
READ_CHUNK = 8 << 20


def store_folder_for(checkpoint: str | Path) -> Path:
    """A folder for the store of the checkpoint in `checkpoint` to suggest: beside it, named
    after it (`moetier convert` refuses to write into the checkpoint's own folder)."""
    path = Path(checkpoint)
    if path.name in ("", ".", ".."):  # `.` names no folder to put the suffix on
        path = path.resolve()
    return path.with_name(f"{path.name}-moetier")


@dataclass(frozen=True)
class BlobEntry:
    layer: int
    expert: int
    plane: str
    offset: int
    nbytes: int
    format: str
    crc32: int


class Store:
    """A converted model on disk; the experts file is memory-mapped, never read whole."""

    @staticmethod
    def check_path(path: str | Path) -> None:
        """Raise what to do where `path` is not a store (its index missing), without reading it:
        a Hugging Face checkpoint is converted into a folder of its own, never into itself."""
        path = Path(path)
        if (path / INDEX_FILE).is_file():
            return
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            raise ValueError(
                f"{path} is a Hugging Face checkpoint, not a moetier store ({INDEX_FILE} "
                f"missing). Convert it into a folder of its own first: moetier convert {path} "
                f"{store_folder_for(path)}"
            )
        raise ValueError(
            f"{path} is not a moetier store ({INDEX_FILE} missing). "
            f"Convert a Hugging Face checkpoint first: moetier convert HF_DIR {path}"
        )

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.check_path(self.path)
        again = "convert the model again"
        self.index: dict[str, Any] = read_json(self.path / INDEX_FILE, again)
        if self.index.get("version") != STORE_VERSION:
            raise ValueError(
                f"{self.path} was written by store version {self.index.get('version')}, this "
                f"moetier reads version {STORE_VERSION}: convert the model again"
            )
        self.hf_config: dict[str, Any] = read_json(self.path / "config.json", again)
        self.model_config = ModelConfig.from_hf(self.hf_config)
        self.source_dtype: str = self.index["source_dtype"]
        self.formats = {k: BlobFormat.from_json(k, v) for k, v in self.index["formats"].items()}
        # layer -> dotted path of the experts module in the transformers model
        self.moe_modules: dict[int, str] = {int(k): v for k, v in self.index["moe_modules"].items()}
        # MTP layers (store layer -> checkpoint prefix, experts module path or None), their
        # dense tensors' names in dense.safetensors; stores written before MTP layers were kept
        # have none
        mtp = self.index.get("mtp_layers", {})
        self.mtp_layers: dict[int, str] = {int(k): v["prefix"] for k, v in mtp.items()}
        self.mtp_modules: dict[int, str] = {
            int(k): v["experts"] for k, v in mtp.items() if v.get("experts")
        }
        self.mtp_dense: frozenset[str] = frozenset(self.index.get("mtp_dense", ()))
        # file name -> {"bytes", "chunk_bytes", "crc32": [per chunk]} (file_record); stores
        # written before the converter recorded them have none
        self.files: dict[str, dict[str, Any]] = self.index.get("files", {})
        # the main model's blobs; the MTP layers' apart (`mtp_blobs`)
        self.blobs: dict[tuple[int, int, str], BlobEntry] = {}
        self.mtp_blobs: dict[tuple[int, int, str], BlobEntry] = {}
        for b in self.index["blobs"]:
            entry = BlobEntry(
                b["layer"],
                b["expert"],
                b["plane"],
                b["offset"],
                b["bytes"],
                b["format"],
                b["crc32"],
            )
            table = self.mtp_blobs if entry.layer in self.mtp_modules else self.blobs
            table[(entry.layer, entry.expert, entry.plane)] = entry
        self._entries = {**self.blobs, **self.mtp_blobs}
        experts_path = self.path / EXPERTS_FILE
        expected = max((e.offset + e.nbytes for e in self._entries.values()), default=0)
        size = experts_path.stat().st_size if experts_path.exists() else -1
        if size < expected:
            raise ValueError(
                f"{experts_path} is missing or truncated ({size} bytes, index needs {expected}): "
                "convert the model again"
            )
        self._file = open(experts_path, "rb")  # noqa: SIM115 - lives as long as the store
        # closed with the store (or at exit), so that no file is left for the interpreter to
        # close with a ResourceWarning; the mapping below keeps its own descriptor
        self._closer = weakref.finalize(self, self._file.close)
        # ACCESS_COPY: a private mapping torch wraps without a read-only warning; never written.
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        # One uint8 tensor over the whole mapping; blobs are slices of it (no copy, no read).
        self._bytes = (
            torch.frombuffer(memoryview(self._mmap), dtype=torch.uint8)
            if self._mmap is not None
            else torch.empty(0, dtype=torch.uint8)
        )

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.moe_modules)

    def adopt_mtp_experts(self, layer: int) -> None:
        """MTP layer `layer`'s routed experts join the main model's (`moe_modules`, `blobs`),
        so that sizing, residency and the experts runtime treat them alike (an MTP layer loaded
        for speculative decoding)."""
        self.moe_modules[layer] = self.mtp_modules[layer]
        self.blobs.update({k: v for k, v in self.mtp_blobs.items() if k[0] == layer})

    @property
    def expert_layers(self) -> list[int]:
        """Every layer with expert blobs: the main model's MoE layers, then MTP layers'."""
        return sorted({*self.moe_modules, *self.mtp_modules})

    @property
    def all_blobs(self) -> dict[tuple[int, int, str], BlobEntry]:
        """Every blob of the store, the MTP layers' included."""
        return self._entries

    def blob(self, layer: int, expert: int, plane: str = "base") -> torch.Tensor:
        """The bytes of one blob (MTP layers' too) as a read-only uint8 CPU tensor backed by the
        mmap."""
        entry = self._entries[(layer, expert, plane)]
        return self._bytes[entry.offset : entry.offset + entry.nbytes]

    def read_blob(self, layer: int, expert: int, plane: str = "base") -> torch.Tensor:
        """A copy of one blob read with an explicit read, not through the mmap: for one pass over
        every blob (re-encoding), which would otherwise leave the whole file mapped in the
        process's resident memory."""
        entry = self._entries[(layer, expert, plane)]
        out = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._file.seek(entry.offset)
        self._file.readinto(out.numpy().data)
        return out

    def has_plane(self, plane: str) -> bool:
        return any(key[2] == plane for key in self.blobs)

    def blob_format(self, layer: int, plane: str = "base") -> BlobFormat:
        entry = self._entries[(layer, 0, plane)]
        return self.formats[entry.format]

    @property
    def expert_params(self) -> int:
        """Weights (and biases) of all routed experts, whatever their storage format."""
        cfg = self.model_config
        per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
        if cfg.expert_has_bias:
            per_expert += 2 * cfg.expert_intermediate_size + cfg.hidden_size
        return per_expert * cfg.num_experts * len(self.moe_layers)

    @property
    def dense_formats(self) -> dict[str, DenseFormat]:
        """Module name -> format of each quantized dense weight (none: all as the checkpoint)."""
        tensors = self.index.get("dense", {}).get("tensors", {})
        return {name: DenseFormat.from_json(info["format"]) for name, info in tensors.items()}

    def _dense_header(self) -> dict[str, Any]:
        """dense.safetensors' tensor records, the MTP layers' (mtp_dense) left out; ValueError
        saying what to do where the header cannot be read."""
        header = self._dense_file_header()
        return {k: v for k, v in header.items() if k != "__metadata__" and k not in self.mtp_dense}

    def _dense_file_header(self) -> dict[str, Any]:
        """dense.safetensors' whole header; ValueError saying what to do where it is damaged."""
        try:
            return safetensors_header(self.path / DENSE_FILE)
        except ValueError as err:
            raise ValueError(f"{err}: {damaged_advice(self.path)}") from None

    @property
    def dense_size(self) -> tuple[int, int]:
        """(parameters, bytes) of dense.safetensors, from its header and the index alone; a
        quantized weight counts its [N, K] parameters, its scales none."""
        quantized = self.index.get("dense", {}).get("tensors", {})
        params = nbytes = 0
        for key, info in self._dense_header().items():
            nbytes += info["data_offsets"][1] - info["data_offsets"][0]
            module, _, leaf = key.rpartition(".")
            if module not in quantized:
                params += math.prod(info["shape"])
            elif leaf == "weight":
                params += math.prod(quantized[module]["shape"])
        return params, nbytes

    @property
    def mtp_dense_size(self) -> tuple[int, int]:
        """(parameters, bytes) of the MTP layers' tensors in dense.safetensors."""
        header = self._dense_file_header()
        infos = [info for key, info in header.items() if key in self.mtp_dense]
        params = sum(math.prod(info["shape"]) for info in infos)
        return params, sum(info["data_offsets"][1] - info["data_offsets"][0] for info in infos)

    def dense_bytes_by_class(self, dtype_bytes: int | None = None) -> dict[str, int]:
        """Bytes of the dense tensors per class (dense_formats.dense_class), as stored, or with
        `dtype_bytes` set, floating tensors that are not quantized counted at that width (what
        the loader casts them to)."""
        quantized = self.index.get("dense", {}).get("tensors", {})
        out: dict[str, int] = {}
        for key, info in self._dense_header().items():
            module = key.rpartition(".")[0]
            if module in quantized:
                klass = quantized[module]["class"]
                size = info["data_offsets"][1] - info["data_offsets"][0]
            else:
                klass = dense_class(key, len(info["shape"]))
                size = info["data_offsets"][1] - info["data_offsets"][0]
                if dtype_bytes is not None and info["dtype"] in ("F32", "BF16", "F16"):
                    size = math.prod(info["shape"]) * dtype_bytes
            out[klass] = out.get(klass, 0) + size
        return out

    @property
    def expert_bytes(self) -> int:
        """Bytes of every expert blob, all planes."""
        return sum(entry.nbytes for entry in self.blobs.values())

    def plane_bits_per_weight(self, plane: str = "base") -> float:
        nbytes = sum(e.nbytes for e in self.blobs.values() if e.plane == plane)
        return 8 * nbytes / self.expert_params

    @property
    def expert_bits_per_weight(self) -> float:
        """Of the base plane: what a token reads when no delta is applied."""
        return self.plane_bits_per_weight("base")

    def verify(self) -> list[tuple[int, int, str]]:
        """Recompute every blob's crc32 (MTP layers' too); returns the keys that do not match."""
        bad = []
        for key, entry in self._entries.items():
            if crc32(self.blob(*key)) != entry.crc32:
                bad.append(key)
        return bad

    def close(self) -> None:
        # Views into the mmap may still be alive in tensors; closing it would make them dangle.
        self._closer()


def blob_index_entry(
    layer: int, expert: int, offset: int, fmt: BlobFormat, blob: torch.Tensor, plane: str = "base"
) -> dict[str, Any]:
    """The experts.json record of one blob whose bytes (at least fmt.nbytes of them) are `blob`."""
    return {
        "layer": layer,
        "expert": expert,
        "plane": plane,
        "offset": offset,
        "bytes": fmt.nbytes,
        "format": fmt.name,
        "shape": {s.name: list(s.shape) for s in fmt.tensors},
        "crc32": crc32(blob[: fmt.nbytes]),
    }


# Tokenizer and chat-template files (one of TOKENIZER_CORE makes a usable tokenizer).
TOKENIZER_GLOBS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "*.model",
    "chat_template*",
    "*.jinja",
)
TOKENIZER_CORE = ("tokenizer.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt")


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer and chat-template files of `folder`; empty when it has no tokenizer
    (none of tokenizer.json, *.model, *.tiktoken, vocab.json, vocab.txt)."""
    if not folder.is_dir() or not any(
        p.is_file() for pattern in TOKENIZER_CORE for p in folder.glob(pattern)
    ):
        return []
    return sorted({p for g in TOKENIZER_GLOBS for p in folder.glob(g) if p.is_file()})


def damaged_advice(store_path: str | Path) -> str:
    """What to do about a damaged file of the store at `store_path`."""
    return f"run `moetier verify {store_path}`; convert the model again or restore the file"


def safetensors_header(path: Path) -> dict[str, Any]:
    """The header of the safetensors file `path` (tensor name -> dtype, shape, data_offsets;
    "__metadata__"), read without asking for more bytes than the file holds. ValueError saying
    what is wrong where the file is missing, its header cut short, not JSON, or where a tensor's
    record is malformed or lies past the end of the file."""
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: unreadable safetensors header (the file has {size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:  # (a damaged length field: reading it would ask for exabytes)
            raise ValueError(
                f"{path}: unreadable safetensors header (its length field says {header_len} "
                f"bytes, the file has {size})"
            )
        text = f.read(header_len)
    try:
        header = json.loads(text)
    except ValueError as err:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ValueError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: unreadable safetensors header (not a JSON object)")
    data = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
            and isinstance(info.get("dtype"), str)
            and isinstance(info.get("shape"), list)
        ):
            raise ValueError(f"{path}: the safetensors header's record of {name} is malformed")
        if offsets[1] > data:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file")
    return header


def file_crc(fd: int, offset: int, nbytes: int) -> int:
    """crc32 of bytes [offset, offset + nbytes) of `fd`, read in chunks with pread (no mmap: a
    pass over the whole file must not stay in the process's resident memory)."""
    crc = 0
    done = 0
    while done < nbytes:
        chunk = os.pread(fd, min(READ_CHUNK, nbytes - done), offset + done)
        if not chunk:
            raise OSError(f"short read at {offset + done}")
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
    return crc & 0xFFFFFFFF


def file_record(path: Path, chunk: int = FILE_CHUNK) -> dict[str, Any]:
    """The index's record of a weights file (CHECKSUMMED_FILES): its size and the crc32 of each
    `chunk` bytes, the last chunk shorter."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        sums = [file_crc(fd, at, min(chunk, size - at)) for at in range(0, size, chunk)]
    finally:
        os.close(fd)
    return {"bytes": size, "chunk_bytes": chunk, "crc32": sums}


def file_records(store_dir: Path) -> dict[str, dict[str, Any]]:
    """The index's "files": the record of each weights file (CHECKSUMMED_FILES) in `store_dir`,
    read once its bytes are final (what a converter writes last, with the index)."""
    return {
        name: file_record(store_dir / name)
        for name in CHECKSUMMED_FILES
        if (store_dir / name).is_file()
    }


def crc32(data: torch.Tensor | bytes | memoryview) -> int:
    if isinstance(data, torch.Tensor):
        data = data.contiguous().numpy().data
    return zlib.crc32(data) & 0xFFFFFFFF
