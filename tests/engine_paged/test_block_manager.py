"""Block manager: page tables, reference counts, fork and copy-on-write stay consistent."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.kv_pool import PageAllocator
from engine_paged.block_manager import BlockManager

PAGE = 4


def make(num_pages: int = 64, watermark: float = 0.0) -> BlockManager:
    return BlockManager(PageAllocator(num_pages), PAGE, watermark=watermark)


def test_prompt_pages_are_shared_and_partial_page_is_copied_on_first_write():
    bm = make()
    bm.append_slots("p", 10)  # 3 pages, last one holds 2 of 4
    parent_pages = list(bm.block_table("p"))
    for i in range(3):
        bm.fork("p", f"c{i}")
    assert bm.num_used_pages == 3  # four sequences, one copy of the prompt
    copies = bm.append_slots("c0", 1)
    assert len(copies) == 1 and copies[0][0] == parent_pages[-1]
    assert bm.block_table("c0")[:2] == parent_pages[:2]
    assert bm.block_table("c0")[-1] != parent_pages[-1]
    # a second write goes to the now-private page: no more copies
    assert bm.append_slots("c0", 1) == []
    bm.check_integrity()
    for seq in ["p", "c0", "c1", "c2"]:
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_pages == 64


def test_full_pages_are_never_copied():
    bm = make()
    bm.append_slots("p", 8)  # exactly 2 full pages
    bm.fork("p", "c")
    assert bm.append_slots("c", 1) == []
    assert bm.block_table("c")[:2] == bm.block_table("p")
    bm.check_integrity()


def test_watermark_keeps_room_for_running_sequences():
    bm = make(num_pages=100, watermark=0.1)
    assert bm.can_admit(90 * PAGE)
    assert not bm.can_admit(91 * PAGE)
    bm.append_slots("a", 90 * PAGE)
    assert bm.can_append("a", 10 * PAGE)  # growth ignores the watermark
    assert not bm.can_append("a", 10 * PAGE + 1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "fork", "free"]), st.integers(0, 7), st.integers(0, 9)),
                max_size=80))
def test_random_operations_keep_integrity_and_end_all_free(ops):
    bm = make(num_pages=48)
    live: list[int] = []
    next_id = 0
    for op, pick, amount in ops:
        if op == "append" or not live:
            if live and pick % 2:
                seq = live[pick % len(live)]
            else:
                seq, next_id = next_id, next_id + 1
            if bm.can_append(seq, amount):
                before = bm.num_free_pages
                bm.append_slots(seq, amount)
                if seq not in live:
                    live.append(seq)
                assert bm.num_free_pages <= before
        elif op == "fork":
            bm.fork(live[pick % len(live)], next_id)
            live.append(next_id)
            next_id += 1
        else:
            bm.free(live.pop(pick % len(live)))
        bm.check_integrity()
        for seq in live:
            assert len(bm.block_table(seq)) == bm.pages_for(bm.num_tokens(seq))
    for seq in live:
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_pages == bm.num_total_pages
