"""Chained block hashes of token ids — the one definition the gateway and the engines share.

    h_0 = H(model_id ‖ 0x00 ‖ cache_salt)
    h_i = H(h_{i-1} ‖ tokens[(i-1)B : iB])        for every FULL block of B tokens

H is BLAKE2b with an 8-byte digest, read as an unsigned little-endian 64-bit int. The parent
hash is passed as the BLAKE2b key (8 bytes, little-endian) rather than concatenated: same
chaining, one copy less. Tokens are packed once as little-endian uint32, so a block is a slice of
one buffer. Chaining makes equal hash i imply (up to collisions) equal blocks 0..i; the salt
changes every hash, so tenants with different salts cannot probe each other's cache. A partial
last block has no hash. Routing tolerates collisions; engine correctness never depends on one.

This sits on the gateway's per-request path: 256 blocks of 16 tokens hash in ~0.2 ms.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache
from hashlib import blake2b

_MASK = (1 << 64) - 1
assert array("I").itemsize == 4 and array("Q").itemsize == 8, "packing needs 4- and 8-byte array items"


@lru_cache(maxsize=256)
def root_hash(model_id: str, cache_salt: str = "") -> int:
    """h_0: the hash every chain of this model (and tenant salt) starts from."""
    # The separator keeps ("ab", "c") and ("a", "bc") apart.
    data = model_id.encode("utf-8") + b"\x00" + cache_salt.encode("utf-8")
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """h_i from h_{i-1} and the i-th block's tokens (one step of `block_hashes`)."""
    return _step(_key(parent), _pack(tokens))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str = "",
    max_blocks: int | None = None,
) -> list[int]:
    """Hashes h_1..h_n of the full blocks of `token_ids` (at most `max_blocks` of them)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        num_blocks = min(num_blocks, max_blocks)
    if num_blocks == 0:
        return []
    data = memoryview(_pack(token_ids[: num_blocks * block_size]))
    stride = block_size * 4
    digests = []
    key = _key(root_hash(model_id, cache_salt))
    for start in range(0, num_blocks * stride, stride):
        key = blake2b(data[start:start + stride], digest_size=8, key=key).digest()
        digests.append(key)  # the digest bytes ARE the little-endian encoding of h_i
    packed = array("Q", b"".join(digests))
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def _key(h: int) -> bytes:
    return (h & _MASK).to_bytes(8, "little")


def _step(key: bytes, block: bytes) -> int:
    return int.from_bytes(blake2b(block, digest_size=8, key=key).digest(), "little")


def _pack(tokens: Sequence[int]) -> bytes:
    if hasattr(tokens, "astype"):  # numpy array: one vectorised conversion
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**32):
            raise ValueError("token ids must be ints in [0, 2**32)")
        return tokens.astype("<u4").tobytes()
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()
