"""process/lookup.unique_pairs answers what np.unique(np.stack([a, b]), axis=1,
return_inverse=True) answers (the pairs in (a, b) order and each row's pair), for the
column types the stages give it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrack.process.lookup import unique_pairs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 7, 2**63 + 5, 2**64 - 1]),
                          st.integers(-3, 2**32 - 1)), max_size=60),
       st.sampled_from([np.int64, np.uint32]))
def test_unique_pairs_as_numpy_unique(rows: list[tuple[int, int]], btype: type) -> None:
    a = np.array([r[0] for r in rows], np.uint64)
    b = np.array([r[1] if btype is np.int64 else abs(r[1]) for r in rows], btype)
    ua, ub, inverse = unique_pairs(a, b)
    assert ua.dtype == a.dtype and ub.dtype == b.dtype
    want = sorted(set(zip(a.tolist(), b.tolist(), strict=True)))
    assert list(zip(ua.tolist(), ub.tolist(), strict=True)) == want
    assert [want[i] for i in inverse.tolist()] == list(zip(a.tolist(), b.tolist(), strict=True))
