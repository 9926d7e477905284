"""engine_paged/sequence.py: `Sequence.outputs` reads the output in place, exactly as the list tail would."""

from __future__ import annotations

import pytest

from engine_paged.sequence import Sequence, TokenTail


def test_outputs_is_the_output_tail_and_follows_appends():
    seq = Sequence(0, [1, 2, 3], 3)
    out = seq.outputs
    assert len(out) == seq.num_output == 0 and list(out) == []
    seq.token_ids += [7, 8, 9]
    assert list(out) == seq.output_token_ids == [7, 8, 9] and seq.num_output == 3  # a view, not a snapshot
    assert (out[0], out[-1], out[1:], out[::-1], out[-2:]) == (7, 9, [8, 9], [9, 8, 7], [8, 9])
    assert 8 in out and 2 not in out  # the prompt is not part of it


@pytest.mark.parametrize("start", [0, 1, 3, 5])
def test_token_tail_indexes_like_the_slice(start):
    ids = [10, 11, 12, 13, 14]
    tail, ref = TokenTail(ids, start), ids[start:]
    assert len(tail) == len(ref) and list(tail) == ref
    for i in range(-len(ref), len(ref)):
        assert tail[i] == ref[i]
    for s in (slice(None), slice(1, None), slice(None, -1), slice(None, None, -1), slice(-3, None, 2)):
        assert tail[s] == ref[s]
    for bad in (len(ref), -len(ref) - 1):
        with pytest.raises(IndexError):
            tail[bad]
