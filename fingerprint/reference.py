"""XXH3-128 (seed 0, default secret) written plainly in Python integers.

The reference the fast paths are held to in tests: the `xxhash` package (CPU),
the torch fallback (torch_path.py) and the Triton kernel
(triton_path.py). Written from the public specification
(Cyan4973/xxHash, doc/xxhash_spec.md); slow (about 1 MB/s), never on a hot path.
Returns the canonical form: high 64 bits then low 64 bits, big-endian, as
``xxhash.xxh3_128(data).digest()``.
"""

from __future__ import annotations

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1
PRIME32_1 = 0x9E3779B1
PRIME32_2 = 0x85EBCA77
PRIME32_3 = 0xC2B2AE3D
PRIME64_1 = 0x9E3779B185EBCA87
PRIME64_2 = 0xC2B2AE3D27D4EB4F
PRIME64_3 = 0x165667B19E3779F9
PRIME64_4 = 0x85EBCA77C2B2AE63
PRIME64_5 = 0x27D4EB2F165667C5
PRIME_MX1 = 0x165667919E3779F9
PRIME_MX2 = 0x9FB21C651E98DF25

SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
STRIPE = 64
STRIPES_PER_BLOCK = (len(SECRET) - 64) // 8  # 16
BLOCK = STRIPE * STRIPES_PER_BLOCK  # 1024
INIT_ACC = (PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1)


def s64(c: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (how the torch and Triton
    paths hold uint64 words)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def u32(b: bytes | memoryview, off: int) -> int:
    return int.from_bytes(b[off:off + 4], "little")


def u64(b: bytes | memoryview, off: int) -> int:
    return int.from_bytes(b[off:off + 8], "little")


def bswap32(x: int) -> int:
    return int.from_bytes(x.to_bytes(4, "little"), "big")


def bswap64(x: int) -> int:
    return int.from_bytes(x.to_bytes(8, "little"), "big")


def rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def mul128_fold64(a: int, b: int) -> int:
    p = a * b
    return (p & M64) ^ (p >> 64)


def avalanche(x: int) -> int:
    x ^= x >> 37
    x = (x * PRIME_MX1) & M64
    return x ^ (x >> 32)


def avalanche_xxh64(x: int) -> int:
    x ^= x >> 33
    x = (x * PRIME64_2) & M64
    x ^= x >> 29
    x = (x * PRIME64_3) & M64
    return x ^ (x >> 32)


def _0to16(d: bytes, n: int) -> tuple[int, int]:
    if n == 0:
        return (avalanche_xxh64(u64(SECRET, 64) ^ u64(SECRET, 72)),
                avalanche_xxh64(u64(SECRET, 80) ^ u64(SECRET, 88)))
    if n <= 3:
        combined = d[n - 1] | (n << 8) | (d[0] << 16) | (d[n >> 1] << 24)
        low = (u32(SECRET, 0) ^ u32(SECRET, 4)) ^ combined
        high = (u32(SECRET, 8) ^ u32(SECRET, 12)) ^ rotl32(bswap32(combined), 13)
        return avalanche_xxh64(low), avalanche_xxh64(high)
    if n <= 8:
        combined = u32(d, 0) | (u32(d, n - 4) << 32)
        value = (u64(SECRET, 16) ^ u64(SECRET, 24)) ^ combined
        p = value * ((PRIME64_1 + (n << 2)) & M64)
        low, high = p & M64, p >> 64
        high = (high + (low << 1)) & M64
        low ^= high >> 3
        low ^= low >> 35
        low = (low * PRIME_MX2) & M64
        low ^= low >> 28
        return low, avalanche(high)
    first, last = u64(d, 0), u64(d, n - 8)
    val1 = (u64(SECRET, 32) ^ u64(SECRET, 40)) ^ first ^ last
    val2 = (u64(SECRET, 48) ^ u64(SECRET, 56)) ^ last
    p = val1 * PRIME64_1
    low = ((p & M64) + ((n - 1) << 54)) & M64
    high = ((p >> 64) + ((val2 >> 32) << 32) + (val2 & M32) * PRIME32_2) & M64
    low ^= bswap64(high)
    p2 = low * PRIME64_2
    low = p2 & M64
    high = ((p2 >> 64) + high * PRIME64_2) & M64
    return avalanche(low), avalanche(high)


def _mix16(d: bytes, off: int, s_off: int) -> int:
    return mul128_fold64(u64(d, off) ^ u64(SECRET, s_off), u64(d, off + 8) ^ u64(SECRET, s_off + 8))


def _mix32(acc: list[int], d: bytes, off1: int, off2: int, s_off: int) -> None:
    acc[0] = (acc[0] + _mix16(d, off1, s_off)) & M64
    acc[1] = (acc[1] + _mix16(d, off2, s_off + 16)) & M64
    acc[0] ^= (u64(d, off2) + u64(d, off2 + 8)) & M64
    acc[1] ^= (u64(d, off1) + u64(d, off1 + 8)) & M64


def _17to240(d: bytes, n: int) -> tuple[int, int]:
    acc = [(n * PRIME64_1) & M64, 0]
    if n <= 128:
        for i in reversed(range(((n - 1) >> 5) + 1)):
            _mix32(acc, d, 16 * i, n - 16 * i - 16, 32 * i)
    else:
        for i in range(4):
            _mix32(acc, d, 32 * i, 32 * i + 16, 32 * i)
        acc = [avalanche(acc[0]), avalanche(acc[1])]
        for i in range(4, n >> 5):
            _mix32(acc, d, 32 * i, 32 * i + 16, 32 * (i - 4) + 3)
        _mix32(acc, d, n - 16, n - 32, 103)
    low = (acc[0] + acc[1]) & M64
    high = (acc[0] * PRIME64_1 + acc[1] * PRIME64_4 + n * PRIME64_2) & M64
    return avalanche(low), (-avalanche(high)) & M64


def _accumulate(acc: list[int], d: bytes, off: int, s_off: int) -> None:
    for i in range(8):
        x = u64(d, off + 8 * i)
        v = x ^ u64(SECRET, s_off + 8 * i)
        acc[i ^ 1] = (acc[i ^ 1] + x) & M64
        acc[i] = (acc[i] + (v & M32) * (v >> 32)) & M64


def _scramble(acc: list[int]) -> None:
    for i in range(8):
        a = acc[i] ^ (acc[i] >> 47) ^ u64(SECRET, len(SECRET) - 64 + 8 * i)
        acc[i] = (a * PRIME32_1) & M64


def _merge(acc: list[int], init: int, s_off: int) -> int:
    r = init
    for i in range(4):
        r += mul128_fold64(acc[2 * i] ^ u64(SECRET, s_off + 16 * i), acc[2 * i + 1] ^ u64(SECRET, s_off + 16 * i + 8))
    return avalanche(r & M64)


def _large(d: bytes, n: int) -> tuple[int, int]:
    acc = list(INIT_ACC)
    n_blocks = (n - 1) // BLOCK  # the last block, full or not, is left to the end
    for b in range(n_blocks):
        for s in range(STRIPES_PER_BLOCK):
            _accumulate(acc, d, b * BLOCK + s * STRIPE, 8 * s)
        _scramble(acc)
    start = n_blocks * BLOCK
    for s in range((n - start - 1) // STRIPE):
        _accumulate(acc, d, start + s * STRIPE, 8 * s)
    _accumulate(acc, d, n - STRIPE, len(SECRET) - 71)
    return (_merge(acc, (n * PRIME64_1) & M64, 11),
            _merge(acc, ~(n * PRIME64_2) & M64, len(SECRET) - 75))


def xxh3_128_words(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(low64, high64) of XXH3-128(data), seed 0, default secret."""
    d = bytes(data)
    n = len(d)
    if n <= 16:
        return _0to16(d, n)
    if n <= 240:
        return _17to240(d, n)
    return _large(d, n)


def xxh3_128(data: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte canonical digest (big-endian: high64 then low64)."""
    low, high = xxh3_128_words(data)
    return high.to_bytes(8, "big") + low.to_bytes(8, "big")
