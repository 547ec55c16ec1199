"""A bit-exact model of the few PTX instructions the 4-bit kernels' inline assembly uses (thunderep/kernels/
half4.py), so that its text is checked on a machine without a CUDA GPU, on numpy arrays of 32-bit registers.

Each instruction follows the PTX ISA's definition: integer operations on the bits; `prmt`'s default mode (a
selector nibble's bit 3 replicates the chosen byte's sign); `lop3`'s lookup table over (0xF0, 0xCC, 0xAA);
float16 arithmetic rounded once to nearest even, subnormals kept (no `.ftz`); `mul`/`sub`/`add` without a
rounding suffix as `.rn` (the default; ptxas may contract a `mul` and a dependent `add` into one multiply-add,
which these chains never offer it: no `mul.f16x2` result is an `add`'s operand); `cvt.rn.f16x2.e4m3x2` exact.
Rounding is computed from the exact value: products of float16 values are exact in float64, and a multiply-add's
sum is rounded with its float64 error term (TwoSum) deciding ties, so no value is rounded twice.
"""

from __future__ import annotations

import re

import numpy as np
import torch

__all__ = ["in_interpreter", "run"]

_M32 = np.uint64(0xFFFFFFFF)
_M16 = np.uint64(0xFFFF)
# e4m3 (the fn variant: no infinities) byte -> float16 bits, exact.
_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_E4M3_F16 = _E4M3.astype(np.float16).view(np.uint16).astype(np.uint64)


def _f16(bits: np.ndarray) -> np.ndarray:
    """16-bit patterns -> float64 values."""
    return (bits & _M16).astype(np.uint16).view(np.float16).astype(np.float64)


def _to_f16(value: np.ndarray, error: np.ndarray | None = None) -> np.ndarray:
    """float64 values -> float16 bits rounded to nearest even; `error` (exact value minus `value`, far under
    its ulp) moves `value` one float64 ulp its way first, which decides the rounding only at a float16 tie."""
    if error is not None:
        value = np.where(error != 0, np.nextafter(value, value + error), value)
    with np.errstate(over="ignore"):
        return value.astype(np.float16).view(np.uint16).astype(np.uint64)


def _halves(op, *regs: np.ndarray) -> np.ndarray:
    """op on each 16-bit half of the registers' float16 pairs, the halves put back."""
    lo = op(*(_f16(r) for r in regs))
    hi = op(*(_f16(r >> np.uint64(16)) for r in regs))
    return lo | (hi << np.uint64(16))


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    ab = a * b  # exact: 22 significant bits
    s = ab + c
    bv = s - ab  # TwoSum: s + err is exactly ab + c
    err = (ab - (s - bv)) + (c - bv)
    return _to_f16(s, err)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits & _M32).astype(np.uint32).view(np.float32).astype(np.float64)


def _to_f32(value: np.ndarray) -> np.ndarray:
    return value.astype(np.float32).view(np.uint32).astype(np.uint64)


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for k in range(8):  # bit k of the table: a's bit = k >> 2, b's = (k >> 1) & 1, c's = k & 1
        if lut >> k & 1:
            sa = a if k & 4 else ~a
            sb = b if k & 2 else ~b
            sc = c if k & 1 else ~c
            out |= sa & sb & sc
    return out & _M32


def _prmt(a, b, sel):
    """Default mode: bytes 0..3 of a, 4..7 of b; byte i of the result from selector nibble i."""
    both = (a & _M32) | ((b & _M32) << np.uint64(32))
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> np.uint64(4 * i)) & np.uint64(15)
        byte = (both >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= np.where(nib & np.uint64(8), sign, byte) << np.uint64(8 * i)
    return out


_OPS = {
    "shr.b32": lambda a, b: (a & _M32) >> b,
    "shl.b32": lambda a, b: (a << b) & _M32,
    "and.b32": lambda a, b: a & b,
    "lop3.b32": lambda a, b, c, lut: _lop3(a, b, c, int(lut)),
    "prmt.b32": _prmt,
    "sub.f16x2": lambda a, b: _halves(lambda x, y: _to_f16(x - y), a, b),
    "mul.f16x2": lambda a, b: _halves(lambda x, y: _to_f16(x * y), a, b),
    "fma.rn.f16x2": lambda a, b, c: _halves(_fma, a, b, c),
    "add.f16": lambda a, b: _to_f16(_f16(a) + _f16(b)),
    "cvt.f32.f16": lambda a: _to_f32(_f16(a)),
    "add.f32": lambda a, b: _to_f32(_f32(a) + _f32(b)),
    "cvt.rn.f16x2.e4m3x2": lambda a: _E4M3_F16[a & np.uint64(0xFF)]
    | (_E4M3_F16[(a >> np.uint64(8)) & np.uint64(0xFF)] << np.uint64(16)),
    "cvt.rn.f16x2.f32": lambda a, b: _to_f16(_f32(b)) | (_to_f16(_f32(a)) << np.uint64(16)),  # d = {a, b}: a high
}


def run(asm: str, *inputs) -> np.ndarray:
    """The 32-bit result ($0, as uint32 bits) of the inline assembly `asm` on the inputs $1, $2, ... (arrays
    broadcast to one shape, or ints); every register the text names is assigned before it is read, or this
    raises."""
    shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
    args = [np.broadcast_to(np.asarray(x, dtype=np.int64).astype(np.uint64) & _M32, shape) for x in inputs]
    regs: dict[str, np.ndarray] = {f"${i + 1}": a for i, a in enumerate(args)}

    def value(token: str) -> np.ndarray:
        token = token.strip()
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", token):
            return np.uint64(int(token, 0))
        if token not in regs:
            raise KeyError(f"register {token} read before it is written")
        return regs[token]

    for line in asm.replace("\n", " ").split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack into two 16-bit registers
            dst, src = rest.split("}", 1)
            lo, hi = (r.strip() for r in dst.strip("{").split(","))
            word = value(src.strip().lstrip(","))
            regs[lo], regs[hi] = word & _M16, (word >> np.uint64(16)) & _M16
            continue
        dst, *srcs = (t.strip() for t in rest.split(","))
        if op == "mov.b32":
            regs[dst] = value(srcs[0]) & _M32
        elif op in _OPS:
            regs[dst] = np.asarray(_OPS[op](*(value(s) for s in srcs)), dtype=np.uint64) & _M32
        else:
            raise NotImplementedError(f"no model of PTX instruction {op!r}")
    return np.broadcast_to(regs["$0"], shape).astype(np.uint32)


class _Results:
    def __init__(self, *results):
        self._results = results

    def get_result(self, i: int):
        return self._results[i]


def in_interpreter(monkeypatch) -> None:
    """Let Triton's CPU interpreter run `tl.inline_asm_elementwise` of one 32-bit result an element (pack 1)
    through this model, for the rest of a test (it raises NotImplementedError otherwise)."""
    from triton.runtime import interpreter

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        if pack != 1 or len(types) != 1:
            raise NotImplementedError(f"the PTX model runs pack 1, one result: pack {pack}, {len(types)} results")
        bits = run(asm, *(v.data.view(np.uint32) for v in values))
        scalar = types[0].scalar
        return _Results(interpreter.TensorHandle(bits.view(interpreter._get_np_dtype(scalar)), scalar))

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm)
