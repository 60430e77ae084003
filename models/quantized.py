"""A GGUF file's low-bit weights kept low-bit on the CPU, run by PyTorch's packed-int4 matmul.

ggml's 4-bit blocks map exactly onto the group-wise int4 format of
``torch.ops.aten._weight_int4pack_mm_for_cpu`` (groups of 32 along the input dimension, which
computes ``w = (u - 8) * scale + zero`` for u in 0..15 with a scale and zero per group and
output row, both in the activations' dtype):

    Q4_1  w = d * u + m     -> scale d,  zero m + 8 d
    Q4_0  w = d * (u - 8)   -> scale d,  zero 0
    Q8_0  w = d * c, c in -128..127, split as c = 16 h + l (h in -8..7, l in 0..15):
          two int4 matrices, (h + 8, scale 16 d, zero 0) and (l, scale d, zero 8 d), summed.

The kernel's fast path takes bfloat16 activations and scales (with float32 ones it runs a
scalar loop, 20-30x slower: docs/cpu.md), so the scales are rounded to bfloat16. Other types
(Q6_K, the K-quants, F16, ...) are dequantised with the ``gguf`` package and kept as dense
bfloat16.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT, GGUFReader
from gguf.quants import dequantize

from .loader import gguf_cache_folder

GROUP = 32            # ggml's block of the types above; also the int4 kernel's group size
ACT_DTYPE = torch.bfloat16


def _pack(codes: np.ndarray) -> torch.Tensor:
    """``codes [N, K]`` in 0..15 -> the kernel's packed layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)


def _scales_and_zeros(scale: np.ndarray, zero: np.ndarray) -> torch.Tensor:
    """``[N, K/32]`` scales and zeros -> ``[K/32, N, 2]`` bfloat16, the kernel's layout."""
    pair = np.stack([scale, zero], axis=-1).astype(np.float32).transpose(1, 0, 2)
    return torch.from_numpy(np.ascontiguousarray(pair)).to(ACT_DTYPE)


class Int4Linear:
    """``x @ W.T`` for W held as one or two group-wise int4 matrices of the same shape."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], out_features: int, in_features: int):
        self.parts = parts
        self.out_features, self.in_features = out_features, in_features
        self.nbytes = sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int4_matmul(x, self.parts)


def int4_matmul(x: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``x`` (bfloat16) times the sum of the int4 matrices ``parts``, transposed."""
    packed, sz = parts[0]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    for packed, sz in parts[1:]:
        y += torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    return y


class DenseLinear:
    """``x @ W.T`` with W dense (a type the int4 kernel cannot hold exactly, or float weights)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


@dataclass
class GgufTensor:
    """One tensor of a GGUF file: its type, its logical shape ``[rows, cols]`` and raw blocks."""
    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray          # quantised: [rows, bytes per row] uint8; float: the values

    def dequantize(self) -> np.ndarray:
        """float32 values, ``shape``, by the gguf package (the reference for everything here)."""
        if self.qtype in (QT.F32, QT.F16, QT.BF16):
            return np.asarray(self.data, dtype=np.float32).reshape(self.shape)
        return dequantize(self.data, self.qtype).reshape(self.shape).astype(np.float32)

    def rows(self, order: np.ndarray) -> "GgufTensor":
        """The same tensor with its rows (output features) reordered: blocks run along a row."""
        return GgufTensor(self.name, self.qtype, self.shape, self.data.reshape(self.shape[0], -1)[order])


def read_gguf(path: Path) -> tuple[str, dict[str, GgufTensor]]:
    """The file's architecture name and its tensors (memory-mapped)."""
    table = _tensor_table(Path(path))
    data = np.memmap(path, mode="r")
    tensors = {}
    for name, qtype, shape, offset, dtype, data_shape in table["tensors"]:
        dtype = np.dtype(dtype)
        count = int(np.prod(data_shape))
        values = data[offset:offset + count * dtype.itemsize].view(dtype).reshape(data_shape)
        tensors[name] = GgufTensor(name, QT(qtype), tuple(shape), values)
    return table["architecture"], tensors


TABLE_VERSION = 1


def _tensor_table(path: Path) -> dict:
    """Where each tensor lies in the file, from gguf's reader. Its parse of the whole file takes
    seconds (the tokenizer's strings), so the table is kept beside the file's conversion in the
    cache (its name carries the file's identity: a changed file gets a table of its own)."""
    kept = gguf_cache_folder(path)
    kept = kept.with_name(kept.name + ".tensors.json")
    try:
        table = json.loads(kept.read_text())
        if table.get("version") == TABLE_VERSION:
            return table
    except (OSError, ValueError):
        pass
    reader = GGUFReader(path)
    table = {"version": TABLE_VERSION, "architecture": str(reader.fields["general.architecture"].contents()),
             "tensors": [[t.name, int(t.tensor_type), [int(n) for n in reversed(t.shape)], int(t.data_offset),
                          t.data.dtype.str, list(t.data.shape)] for t in reader.tensors]}
    partial = kept.with_name(f"{kept.name}.{os.getpid()}")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(table))
        os.replace(partial, kept)
    except OSError:
        pass                         # a read-only cache: parsed again next time
    return table


def _blocks(t: GgufTensor, block_bytes: int) -> np.ndarray:
    rows, cols = t.shape
    return np.ascontiguousarray(t.data).reshape(rows, cols // GROUP, block_bytes)


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes of a 4-bit block: element j in the low nibble of byte j, j + 16 in the high."""
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return codes.reshape(qs.shape[0], -1)


def int4_parts(t: GgufTensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The tensor as int4 matrices whose sum is exactly its weights (scales rounded to bfloat16),
    or None when its type has no such form."""
    if len(t.shape) != 2 or t.shape[1] % GROUP:
        return None
    if t.qtype == QT.Q4_1:
        b = _blocks(t, 20)
        d, m = _half(b, 0), _half(b, 2)
        return [(_pack(_nibbles(b[..., 4:])), _scales_and_zeros(d, m + 8 * d))]
    if t.qtype == QT.Q4_0:
        b = _blocks(t, 18)
        d = _half(b, 0)
        return [(_pack(_nibbles(b[..., 2:])), _scales_and_zeros(d, np.zeros_like(d)))]
    if t.qtype == QT.Q8_0:
        b = _blocks(t, 34)
        d = _half(b, 0)
        c = b[..., 2:].view(np.int8).astype(np.int16).reshape(t.shape)
        high, low = (c >> 4) + 8, c & 0x0F                    # c = 16 (high - 8) + low
        return [(_pack(high), _scales_and_zeros(16 * d, np.zeros_like(d))),
                (_pack(low), _scales_and_zeros(d, 8 * d))]
    return None


def linear_from_gguf(t: GgufTensor) -> Int4Linear | DenseLinear:
    parts = int4_parts(t)
    if parts is None:
        return DenseLinear(torch.from_numpy(t.dequantize()).to(ACT_DTYPE))
    return Int4Linear(parts, *t.shape)


class QuantizedEmbedding:
    """Rows of a Q8_0 / Q4_x table gathered and dequantised per lookup (exact, float32)."""

    def __init__(self, t: GgufTensor):
        rows, cols = t.shape
        if t.qtype == QT.Q8_0:
            b = _blocks(t, 34)
            self.codes = torch.from_numpy(b[..., 2:].copy().view(np.int8).reshape(rows, cols))
            self.scale, self.zero = torch.from_numpy(_half(b, 0)), None
        elif t.qtype in (QT.Q4_0, QT.Q4_1):
            b = _blocks(t, 20 if t.qtype == QT.Q4_1 else 18)
            d = _half(b, 0)
            codes = _nibbles(b[..., 4:] if t.qtype == QT.Q4_1 else b[..., 2:]).astype(np.int8)
            self.codes = torch.from_numpy(codes.reshape(rows, cols))
            self.scale = torch.from_numpy(d)
            self.zero = torch.from_numpy(_half(b, 2) if t.qtype == QT.Q4_1 else -8 * d)
        else:
            raise ValueError(f"no quantised embedding for {t.qtype.name}")
        self.cols = cols

    @staticmethod
    def supports(t: GgufTensor) -> bool:
        return t.qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1) and len(t.shape) == 2 and t.shape[1] % GROUP == 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        codes = self.codes[ids].float().unflatten(-1, (-1, GROUP))
        w = codes * self.scale[ids].unsqueeze(-1)
        if self.zero is not None:
            w += self.zero[ids].unsqueeze(-1)
        return w.flatten(-2)
