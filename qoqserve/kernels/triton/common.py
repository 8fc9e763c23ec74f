"""Small device functions shared by the kernels, written to match torch's
numerics bit for bit where the reference is exact.

No module-level Python number may be read inside a jit function: the
compiler refuses non-constexpr globals (the interpreter does not check), so
constants are written as literals; tests/test_triton_aot.py compiles every
kernel for sm_80/sm_90 to keep it that way.
"""
import triton
import triton.language as tl

from qoqserve.kernels.triton import interpreting

if interpreting():
    from qoqserve.kernels.triton.interpreter_compat import patch_interpreter

    patch_interpreter()


@triton.jit
def rint(v):
    # Adding and removing 1.5 * 2^23 rounds an fp32 |v| < 2^22 to the nearest
    # integer, ties to even -- torch.round's rule. libdevice.rint does the same
    # on GPU but has no interpreter implementation, and one function must serve both.
    return (v + 12582912.0) - 12582912.0


@triton.jit
def quantize_row_int8(y):
    """Symmetric INT8 of one fp32 row (padding must be 0): codes, scale (= amax/127, or 1)."""
    amax = tl.max(tl.abs(y), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    q = tl.minimum(tl.maximum(rint(tl.math.div_rn(y, scale)), -127.0), 127.0)
    return q.to(tl.int8), scale


@triton.jit
def unpack_uint4(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """uint8 [ROWS, COLS // 2] -> uint8 codes [ROWS, COLS]; low nibble = even column."""
    # explicit casts: the result type must not depend on how a Triton version
    # types `uint8 & python int`
    lo = (packed & 0xF).to(tl.uint8)
    hi = (packed >> 4).to(tl.uint8)
    return tl.reshape(tl.join(lo, hi), (ROWS, COLS))


@triton.jit
def fp16_from_bytes(lo, hi):
    """Two uint8 tensors (little endian) -> the fp16 they encode, as fp32."""
    bits = (lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp16_pair_from_word(word):
    """One little-endian 32-bit word holding two fp16 (low half first) -> both, as fp32."""
    w = word.to(tl.uint32, bitcast=True)
    lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi
