"""Small device functions shared by the kernels, written to match torch's
numerics bit for bit where the reference is exact."""
import triton
import triton.language as tl

# Adding and removing 1.5 * 2^23 rounds an fp32 |v| < 2^22 to the nearest
# integer, ties to even -- torch.round's rule. libdevice.rint does the same on
# GPU but has no interpreter implementation, and one function must serve both.
_RINT_MAGIC = 12582912.0


@triton.jit
def rint(v):
    return (v + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def quantize_row_int8(y):
    """Symmetric INT8 of one fp32 row (padding must be 0): codes, scale (= amax/127, or 1)."""
    amax = tl.max(tl.abs(y), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    q = tl.minimum(tl.maximum(rint(tl.math.div_rn(y, scale)), -127.0), 127.0)
    return q.to(tl.int8), scale


@triton.jit
def unpack_uint4(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """uint8 [ROWS, COLS // 2] -> codes [ROWS, COLS]; low nibble = even column."""
    return tl.reshape(tl.join(packed & 0xF, packed >> 4), (ROWS, COLS))


@triton.jit
def fp16_from_bytes(lo, hi):
    """Two uint8 tensors (little endian) -> the fp16 they encode, as fp32."""
    bits = lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)
