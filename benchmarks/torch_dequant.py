"""GGUF dequantisation written in torch ops: the torch side of bench_quant's "dequantise + matmul" peer.

`TorchDequantiser(qtype, n, k)(raw)` takes the raw block bytes of a `[n, k]` weight (a uint8 tensor in
ggml's layout) and returns the f32 `[n, k]` weight in a buffer it owns and reuses call after call, as a
runtime that dequantises on the fly would (a fresh 64 MiB result each call spent more time faulting its
pages in than computing). It computes in the order of the `gguf` package's dequantiser (scale products
first, then the codes), so the two agree bit for bit (tests/test_bench_quant.py checks it). Written from
ggml's block layouts:
- Q8_0, 34 bytes per 32 weights: f16 d, 32 int8 codes; w = d·q.
- Q4_0, 18 bytes per 32 weights: f16 d, 16 bytes of 4-bit codes (weights 0-15 in the low nibbles,
  16-31 in the high ones); w = d·(q − 8).
- Q4_K, 144 bytes per 256 weights: f16 d and dmin, 12 bytes packing eight 6-bit scales and eight 6-bit
  mins, 128 bytes of 4-bit codes (each 32 bytes hold a 64-weight span: the low nibbles its first 32-weight
  sub-block, the high nibbles its second); w = (d·scale)·q − (dmin·min).
- Q6_K, 210 bytes per 256 weights: 128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen int8 scales
  (one per 16 weights), f16 d; w = (d·scale)·(q − 32).
"""

from __future__ import annotations

from typing import Any

from fuel.errors import ParamError, ShapeError

# (weights, bytes) of one block
BLOCKS = {"Q4_0": (32, 18), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def _f16(blocks: Any, field: int) -> Any:
    """The f16 at byte 2·`field` of every block (blocks of an even byte count), as f32 `[blocks, 1]`."""
    import torch

    return blocks.view(torch.int16)[:, field].view(torch.float16).to(torch.float32).unsqueeze(1)


def _nibbles(packed: Any, out: Any, dim: int) -> None:
    """Low nibbles of `packed` at index 0 of `out`'s dimension `dim`, high nibbles at index 1."""
    import torch

    torch.bitwise_and(packed, 15, out=out.select(dim, 0))
    torch.bitwise_right_shift(packed, 4, out=out.select(dim, 1))


class TorchDequantiser:
    """Dequantises one GGUF type of one `[n, k]` shape into its own f32 buffer (see the module docstring)."""

    def __init__(self, qtype: str, n: int, k: int) -> None:
        import torch

        if qtype not in BLOCKS:
            raise ParamError(f"torch_dequant: type {qtype!r} has no torch dequantiser; expected one of "
                             f"{sorted(BLOCKS)}")
        per_block, nbytes = BLOCKS[qtype]
        if n < 1 or k < 1 or k % per_block:
            raise ShapeError(f"torch_dequant: {qtype} needs k a positive multiple of {per_block} and n >= 1, "
                             f"got [{n}, {k}]")
        self.qtype, self.n, self.k, self.nbytes = qtype, n, k, nbytes
        self.blocks = n * k // per_block
        self.out = torch.empty(self.blocks, per_block, dtype=torch.float32)
        self.codes = torch.empty(self.blocks, per_block, dtype=torch.uint8)
        self.high = torch.empty(self.blocks, 2, 4, 32, dtype=torch.uint8) if qtype == "Q6_K" else None
        self.shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)

    def __call__(self, raw: Any) -> Any:
        import torch

        if raw.dtype != torch.uint8 or raw.numel() != self.blocks * self.nbytes:
            raise ShapeError(f"torch_dequant: {self.qtype} [{self.n}, {self.k}] needs "
                             f"{self.blocks * self.nbytes} uint8 bytes, got {raw.numel()} {raw.dtype}")
        b = raw.reshape(self.blocks, self.nbytes)
        getattr(self, "_" + self.qtype.lower())(b)
        return self.out.view(self.n, self.k)

    def _q8_0(self, b: Any) -> None:
        import torch

        self.out.copy_(b[:, 2:].view(torch.int8))
        self.out.mul_(_f16(b, 0))

    def _q4_0(self, b: Any) -> None:
        import torch

        _nibbles(b[:, 2:], self.codes.view(-1, 2, 16), 1)
        codes = self.codes.view(torch.int8)
        codes.sub_(8)
        self.out.copy_(codes)
        self.out.mul_(_f16(b, 0))

    def _q4_k(self, b: Any) -> None:
        import torch

        s0, s1, s2 = b[:, 4:8], b[:, 8:12], b[:, 12:16]
        # sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7: the nibbles
        # of bytes 8-11, topped by the high 2 bits of bytes 0-3 (scales) and 4-7 (mins)
        scales = torch.cat((s0 & 63, (s2 & 15) | ((s0 >> 6) << 4)), dim=1)
        mins = torch.cat((s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)), dim=1)
        _nibbles(b[:, 16:].reshape(-1, 4, 32), self.codes.view(-1, 4, 2, 32), 2)
        out = self.out.view(-1, 8, 32)
        out.copy_(self.codes.view(-1, 8, 32))
        out.mul_((_f16(b, 0) * scales).unsqueeze(-1))
        out.sub_((_f16(b, 1) * mins).unsqueeze(-1))

    def _q6_k(self, b: Any) -> None:
        import torch

        # ql [half, 32-byte run, l]: weight 128·half + 64·nibble + 32·run + l; qh [half, l]: two bits for
        # each of the half's four 32-weight groups, group g in bits 2g and 2g + 1
        low = self.codes.view(-1, 2, 2, 2, 32)
        _nibbles(b[:, :128].reshape(-1, 2, 2, 32), low, 2)
        high = self.high
        assert high is not None
        torch.bitwise_right_shift(b[:, 128:192].reshape(-1, 2, 1, 32), self.shifts, out=high)
        high.bitwise_and_(3).bitwise_left_shift_(4)
        codes = self.codes.view(-1, 2, 4, 32)
        codes.bitwise_or_(high)
        signed = self.codes.view(torch.int8)
        signed.sub_(32)
        out = self.out.view(-1, 16, 16)
        out.copy_(signed.view(-1, 16, 16))
        out.mul_((_f16(b, 104) * b[:, 192:208].view(torch.int8)).unsqueeze(-1))


def dequantize(raw: Any, qtype: str, n: int, k: int) -> Any:
    """A fresh f32 `[n, k]` torch tensor of a GGUF weight from its block bytes."""
    return TorchDequantiser(qtype, n, k)(raw).clone()
