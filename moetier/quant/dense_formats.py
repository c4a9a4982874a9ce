"""Dense (non-expert) weight formats of the store, chosen per tensor class (docs/formats.md,
"Dense formats"; the kernels in kernels/dense_gemv.py read them).

Classes (`dense_class`, by the HF module name): `attention` (the attention block's projections),
`shared` (shared experts), `mlp` (dense MLP layers), `lm_head`; everything else — embeddings,
norms, routers, biases, 1-D tensors — stays as the checkpoint has it (`embed`, `router`,
`other` in the byte report).

Formats (`DenseFormat`), each stored under the weight's own name plus its scales:
  bf16        unquantized: the checkpoint's float dtype (FP8 source weights dequantised to the
              config's dtype), the store's default
  fp8         `weight` float8_e4m3fn [N, K] + `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)]:
              W = fp8 * the scale of its bn x bk tile (DeepSeek-V3's names). An FP8 checkpoint's
              tensors are kept bit for bit with its own tile (128 x 128 for DeepSeek-V3);
              weights from a float checkpoint get one scale per row and 128 columns (1 x 128),
              each the one of absmax/448 * 2^(j/16), j < 16, with the least squared error
              (docs/quality.md: 0.75x the error of absmax/448 per 128 x 128 tile);
              `fp8-bNxK` asks for another tile
  int4-g{G}   `weight` uint8 [N, K/2] (two codes a byte, even element low; q + 8) +
              `weight_scale` bfloat16 [N, K/G]: symmetric, W = q * scale, q in -8..7, the scale of
              each group chosen among a few clip ratios for the least squared error (default G 128)
  nvfp4       `weight` uint8 [N, K/2] E2M1 + `weight_scale` float8_e4m3fn [N, K/16] +
              `weight_scale_2` float32 [1] (ModelOpt's names; quant/fp4.quantize_nvfp4)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.kernels.dense_gemv import dense_dequant_ref
from moetier.quant.fp4 import E4M3_MAX, pack_nibbles, quantize_nvfp4

CLASSES = ("attention", "shared", "mlp", "lm_head")
KINDS = ("bf16", "fp8", "int4", "nvfp4")
# `--dense auto` tries these in this order (residency/dense_choice.py), issue #52's. nvfp4 (4.5
# bits a weight) is larger than int4-g128 (4.125): it is reached where int4 leaves tensors whose
# K is no multiple of 128 in bf16 and nvfp4 (blocks of 16) does not
AUTO_ORDER = ("bf16", "fp8", "int4", "nvfp4")
FP8_BLOCK = (1, 128)  # a float checkpoint's fp8 tile (FP8 checkpoints keep their own)
FP8_SCALE_STEPS = 16  # candidate scales per tile: absmax/448 * 2^(j/16), j < 16
INT4_GROUP = 128
# clip ratios tried per int4 group (scale = ratio * absmax / 7); 8/7 lets -8 take the extreme
_INT4_CLIPS = (8 / 7, 1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
_PROJECTION = re.compile(r"(_proj|_proj_with_mqa|\.w[123]|\.wq\w*|\.wkv\w*|\.wo)\.weight$")
_ATTENTION = re.compile(r"\.(self_attn|attention|attn|self_attention)\.")


def dense_class(key: str, ndim: int = 2) -> str:
    """The class of a dense tensor by its model name: one of CLASSES (quantizable), or
    'embed', 'router', 'other' (kept as they are)."""
    if key == "lm_head.weight" or key.endswith(".lm_head.weight"):
        return "lm_head"
    if "embed" in key:
        return "embed"
    if ndim != 2 or not _PROJECTION.search(key):
        return (
            "router" if re.search(r"\.(gate|router|shared_expert_gate)\.weight$", key) else "other"
        )
    if _ATTENTION.search(key):
        return "attention"
    if "shared_expert" in key:
        return "shared"
    if ".mlp." in key or ".feed_forward." in key:
        return "mlp"
    return "other"


@dataclass(frozen=True)
class DenseFormat:
    kind: str  # one of KINDS
    block: tuple[int, int] = FP8_BLOCK  # fp8: the scale tile (rows, columns)
    group: int = INT4_GROUP  # int4: weights per scale along K
    source: bool = False  # fp8 tensors kept bit for bit from an FP8 checkpoint

    @classmethod
    def parse(cls, text: str) -> DenseFormat:
        """'bf16', 'fp8', 'fp8-b128x128', 'int4', 'int4-g64', 'nvfp4'."""
        match = re.fullmatch(r"(bf16|fp8|nvfp4)|int4(?:-g(\d+))?|fp8-b(\d+)x(\d+)", text.strip())
        if match is None or (match.group(3) and min(int(match.group(3)), int(match.group(4))) < 1):
            raise ValueError(
                f"dense format {text!r}: one of bf16, fp8, fp8-bNxK (a scale per N x K tile), "
                "int4, int4-gN (N a power of two >= 2), nvfp4"
            )
        if match.group(3):
            return cls("fp8", (int(match.group(3)), int(match.group(4))))
        if match.group(1):
            return cls(match.group(1))
        group = int(match.group(2) or INT4_GROUP)
        if group < 2 or group & (group - 1):
            raise ValueError(f"dense format {text!r}: the int4 group must be a power of two >= 2")
        return cls("int4", group=group)

    @property
    def name(self) -> str:
        if self.kind == "int4":
            return f"int4-g{self.group}"
        if self.kind == "fp8":
            name = f"fp8-b{self.block[0]}x{self.block[1]}"
            return name + ("-source" if self.source else "")
        return self.kind

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a [N, K] weight can be stored so (int4 and nvfp4 need K in whole groups)."""
        if len(shape) != 2:
            return False
        if self.kind == "int4":
            return shape[1] % self.group == 0
        if self.kind == "nvfp4":
            return shape[1] % 16 == 0
        return True

    def tensors(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of what the store holds for weight `key` ([N, K], '....weight')."""
        n, k = shape
        prefix = key[: -len("weight")]
        if self.kind == "fp8":
            grid = (-(-n // self.block[0]), -(-k // self.block[1]))
            return [(key, "float8_e4m3fn", (n, k)), (prefix + "weight_scale_inv", "float32", grid)]
        if self.kind == "int4":
            return [
                (key, "uint8", (n, k // 2)),
                (prefix + "weight_scale", "bfloat16", (n, k // self.group)),
            ]
        if self.kind == "nvfp4":
            return [
                (key, "uint8", (n, k // 2)),
                (prefix + "weight_scale", "float8_e4m3fn", (n, k // 16)),
                (prefix + "weight_scale_2", "float32", (1,)),
            ]
        raise ValueError(f"{self.kind} is not a quantized dense format")

    def kernel_args(self) -> tuple[str, int, int]:
        """(kind, block_n, block_k) as kernels/dense_gemv.py takes them."""
        if self.kind == "fp8":
            return "fp8", self.block[0], self.block[1]
        if self.kind == "int4":
            return "int4", 1, self.group
        return "nvfp4", 1, 16

    def quantize(self, w: torch.Tensor) -> list[torch.Tensor]:
        """A float weight [N, K] -> the stored tensors, in the order of `tensors`."""
        if self.kind == "fp8":
            return list(quantize_fp8_block(w, self.block))
        if self.kind == "int4":
            return list(quantize_int4(w, self.group))
        if self.kind == "nvfp4":
            q = quantize_nvfp4(w)
            return [pack_nibbles(q.codes), q.scales, q.tensor_scale.float().reshape(1)]
        raise ValueError(f"{self.kind} is not a quantized dense format")

    def dequantize(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The stored tensors -> the float32 weight [N, K]."""
        kind, bn, bk = self.kernel_args()
        return dense_dequant_ref(parts[0], parts[1], parts[2] if len(parts) > 2 else None,
                                 kind, bn, bk)  # fmt: skip

    def bits_per_weight(self, shape: tuple[int, int]) -> float:
        nbytes = sum(
            torch.empty(0, dtype=getattr(torch, dtype)).element_size() * _prod(s)
            for _, dtype, s in self.tensors("x.weight", shape)
        )
        return 8 * nbytes / _prod(shape)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "fp8":
            out.update(block=list(self.block), source=self.source)
        if self.kind == "int4":
            out["group"] = self.group
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DenseFormat:
        return cls(
            data["kind"],
            tuple(data.get("block", FP8_BLOCK)),  # type: ignore[arg-type]
            int(data.get("group", INT4_GROUP)),
            bool(data.get("source", False)),
        )


@dataclass(frozen=True)
class DensePolicy:
    """`--dense FORMAT` and `--dense-override CLASS=FORMAT`: the format of each class."""

    default: DenseFormat = field(default_factory=lambda: DenseFormat("bf16"))
    overrides: tuple[tuple[str, DenseFormat], ...] = ()

    @classmethod
    def parse(
        cls, default: str = "bf16", overrides: tuple[str, ...] | list[str] = ()
    ) -> DensePolicy:
        parsed = []
        for text in overrides:
            klass, sep, fmt = text.partition("=")
            if not sep or klass.strip() not in CLASSES:
                raise ValueError(
                    f"--dense-override {text!r}: write CLASS=FORMAT, CLASS one of "
                    f"{', '.join(CLASSES)}"
                )
            parsed.append((klass.strip(), DenseFormat.parse(fmt)))
        return cls(DenseFormat.parse(default), tuple(parsed))

    def format_of(self, klass: str) -> DenseFormat:
        fmt = self.default
        for name, override in self.overrides:
            if name == klass:
                fmt = override
        return fmt

    def choose(
        self, key: str, shape: tuple[int, ...], source_fp8: tuple[int, int] | None = None
    ) -> DenseFormat | None:
        """The format of dense tensor `key` (None: stored as the checkpoint has it, or
        dequantised for an FP8 source). source_fp8: the tile of an FP8 source tensor, kept as
        it is when its class asks for fp8."""
        klass = dense_class(key, len(shape))
        if klass not in CLASSES:
            return None
        fmt = self.format_of(klass)
        if not fmt.quantized or not fmt.fits(shape):
            return None
        if fmt.kind == "fp8" and source_fp8 is not None:
            return DenseFormat("fp8", source_fp8, source=True)
        return fmt

    def unfit(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """One line naming the weights (of `shapes`, name -> shape) of a quantized class that
        `choose` leaves as the checkpoint has them, their K not in whole groups of the class's
        format, with the group that would fit them; None when every such weight fits."""
        left: dict[DenseFormat, list[tuple[str, int]]] = {}
        for name, shape in sorted(shapes.items()):
            klass = dense_class(name, len(shape))
            fmt = self.format_of(klass) if klass in CLASSES else None
            if fmt is not None and fmt.quantized and len(shape) == 2 and not fmt.fits(shape):
                left.setdefault(fmt, []).append((name, shape[1]))
        parts = []
        for fmt, weights in left.items():
            need = fmt.group if fmt.kind == "int4" else 16
            named = ", ".join(f"{name} (K {k})" for name, k in weights[:3])
            more = f" and {len(weights) - 3} more" if len(weights) > 3 else ""
            part = (
                f"{fmt.name}: {len(weights)} weight(s) stay as the checkpoint has them, their K "
                f"is not a multiple of {need}: {named}{more}"
            )
            if fmt.kind == "int4":
                k = math.gcd(*(k for _, k in weights))
                group = k & -k  # the largest power of two dividing every K
                part += (
                    f"; int4-g{group} (or a smaller group) would fit them"
                    if group >= 2
                    else "; no int4 group fits an odd K"
                )
            parts.append(part)
        return "; ".join(parts) or None

    def to_json(self) -> dict[str, Any]:
        return {
            "default": self.default.name,
            "overrides": {k: f.name for k, f in self.overrides},
        }


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, steps: int = FP8_SCALE_STEPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)]), DeepSeek-
    V3's layout. Each tile's scale is the one of absmax/448 * 2^(j/steps), j < steps, whose
    round-to-nearest E4M3 codes give the least squared error (steps=1: absmax/448, DeepSeek's
    rule): E4M3's rounding error depends on where a tile's largest values fall between powers
    of two, and those dominate its squared error. Rows are processed in chunks (bounded
    memory for the largest weights)."""
    w = w.float()
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale_inv = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    chunk = max(1, (1 << 22) // max(1, bn * cols * bk))  # tile rows per pass: ~16 MiB of fp32
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        part = torch.zeros((r1 - r0) * bn, cols * bk)
        a, b = r0 * bn, min(n, r1 * bn)
        part[: b - a, :k] = w[a:b]
        tiles = part.view(r1 - r0, bn, cols, bk)
        amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
        base = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        best, best_err = base, None
        for j in range(steps):
            scale = base * 2.0 ** (j / steps) if j else base
            rec = (tiles / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
            err = (rec * scale - tiles).pow(2).sum(dim=(1, 3), keepdim=True)
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best = torch.where(better, scale, best)
            best_err = torch.where(better, err, best_err)
        codes = (tiles / best).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        q[a:b] = codes.view((r1 - r0) * bn, cols * bk)[: b - a, :k]
        scale_inv[r0:r1] = best.view(r1 - r0, cols)
    return q, scale_inv


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (uint8 [N, K/2] codes q + 8, bfloat16 scales [N, K/group]): symmetric
    round to nearest on -8..7; per group the clip ratio (of _INT4_CLIPS) with the least squared
    error, the scale rounded to bf16 before the codes are chosen."""
    w = w.float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4-g{group} needs K divisible by {group}, got {tuple(w.shape)}")
    groups = w.view(n, k // group, group)
    amax = groups.abs().amax(-1, keepdim=True)
    best_err = torch.full_like(amax, float("inf"))
    best_scale = torch.ones_like(amax)
    for clip in _INT4_CLIPS:
        scale = (amax * clip / 7).to(torch.bfloat16).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (groups / scale).round().clamp(-8, 7)
        err = (q * scale - groups).pow(2).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    q = (groups / best_scale).round().clamp(-8, 7).to(torch.int16) + 8
    codes = pack_nibbles(q.view(n, k).to(torch.uint8))
    return codes, best_scale[..., 0].to(torch.bfloat16)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
