"""Chained block hashes: the prefix-match semantics routing relies on, tenant isolation, speed."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duet.hashing import block_hashes, chain_hash, root_hash

B = 16
tokens = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=8 * B)


def test_golden_values() -> None:
    # The gateway, both engines and the sim engine must agree across processes and versions:
    # changing the definition silently would make every routing index miss. Update deliberately.
    assert root_hash("tiny-llama") == 10726180676091591440
    assert root_hash("tiny-llama", "tenant-a") == 3310985992001353936
    assert block_hashes(list(range(40)), 16, "tiny-llama") == [5471674973011257869, 10545327895328586424]


@settings(max_examples=200)
@given(tokens)
def test_one_hash_per_full_block_partial_block_ignored(ids: list[int]) -> None:
    hashes = block_hashes(ids, B, "m")
    assert len(hashes) == len(ids) // B
    assert all(0 <= h < 2**64 for h in hashes)
    # Growing the partial last block (without completing it) changes nothing.
    assert block_hashes(ids + [7] * (B - 1 - len(ids) % B), B, "m") == hashes


@settings(max_examples=200)
@given(tokens, tokens)
def test_equal_prefix_blocks_give_equal_hashes(a: list[int], b: list[int]) -> None:
    ha, hb = block_hashes(a, B, "m"), block_hashes(b, B, "m")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared = common // B  # blocks entirely inside the common prefix
    assert ha[:shared] == hb[:shared]
    # Past the first differing block, every hash differs (the chain carries the difference).
    assert all(x != y for x, y in zip(ha[shared:], hb[shared:], strict=False))


def test_change_in_block_i_changes_hashes_from_i_on() -> None:
    ids = list(range(1000, 1000 + 6 * B))
    base = block_hashes(ids, B, "m")
    for i in range(6):
        changed = list(ids)
        changed[i * B + 5] += 1
        h = block_hashes(changed, B, "m")
        assert h[:i] == base[:i]
        assert all(x != y for x, y in zip(h[i:], base[i:], strict=True))


def test_salt_and_model_change_everything() -> None:
    ids = list(range(4 * B))
    base = block_hashes(ids, B, "m")
    for other in (block_hashes(ids, B, "m", cache_salt="tenant"), block_hashes(ids, B, "m2")):
        assert all(x != y for x, y in zip(other, base, strict=True))
    # model_id and salt are separated: ("ab", "c") is not ("a", "bc").
    assert root_hash("ab", "c") != root_hash("a", "bc")


def test_chain_hash_is_one_step_of_block_hashes() -> None:
    ids = list(range(3 * B))
    h = root_hash("m", "s")
    steps = []
    for i in range(3):
        h = chain_hash(h, ids[i * B:(i + 1) * B])
        steps.append(h)
    assert steps == block_hashes(ids, B, "m", "s")


def test_max_blocks_and_numpy_input() -> None:
    ids = list(range(10 * B + 3))
    full = block_hashes(ids, B, "m")
    assert block_hashes(ids, B, "m", max_blocks=4) == full[:4]
    assert block_hashes(ids, B, "m", max_blocks=0) == []
    assert block_hashes(np.array(ids, dtype=np.int64), B, "m") == full
    assert block_hashes(ids, 8, "m") != full[:5]


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0, "m")
    with pytest.raises(ValueError, match="max_blocks"):
        block_hashes([1, 2], 1, "m", max_blocks=-1)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([1, -2], 1, "m")
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([1, 2**32], 1, "m")
    with pytest.raises(ValueError, match="token ids"):
        block_hashes(np.array([1, -1]), 1, "m")


def test_hashing_a_long_prompt_head_is_fast() -> None:
    # The gateway hashes up to 256 blocks of every prompt; this is a loose guard (shared CI cores),
    # the target is ~0.3 ms.
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 150_000, 8000)]
    block_hashes(ids, B, "m", max_blocks=256)
    start = time.perf_counter()
    for _ in range(50):
        assert len(block_hashes(ids, B, "m", max_blocks=256)) == 256
    assert (time.perf_counter() - start) / 50 < 0.005
