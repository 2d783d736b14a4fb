"""The engines' block pool: the lowest free ids first, all-or-nothing frees, nothing lost on a refusal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.engine.block_manager import BlockManager, OutOfBlocks

# an op: ("alloc", n) or ("free", index of a held allocation); the model is a set of free ids
OPS = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(0, 12)), st.tuples(st.just("free"), st.integers(0, 50))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 40), ops=OPS)
def test_matches_a_sorted_free_set(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Against the obvious model: each allocation is the n lowest free ids, ascending; frees come
    back whatever their order; a request for more than is free raises and changes nothing."""
    bm = BlockManager(num_blocks, 16)
    free = set(range(num_blocks))
    held: list[list[int]] = []
    for i, (op, arg) in enumerate(ops):
        if op == "alloc":
            if arg > len(free):
                with pytest.raises(OutOfBlocks):
                    bm.allocate(arg, f"r{i}")
                assert bm.try_allocate(arg, f"r{i}") is None
            else:
                got = bm.allocate(arg, f"r{i}")
                assert got == sorted(free)[:arg]
                free -= set(got)
                held.append(got)
        elif held:
            ids = held.pop(arg % len(held))
            bm.free(ids[::-1])  # any order
            free |= set(ids)
        assert bm.num_free == len(free)
        assert sum(bm.owners().values()) == num_blocks - len(free)


def test_a_double_free_is_refused_before_anything_moves() -> None:
    bm = BlockManager(8, 16)
    a = bm.allocate(3, "a")
    b = bm.allocate(2, "b")
    bm.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        bm.free([b[0], a[1], b[1]])  # a[1] is already free: b's blocks stay held
    assert bm.owners() == {"b": 2} and bm.num_free == 6
    with pytest.raises(ValueError, match="not allocated"):
        bm.free([b[0], b[0]])  # the same id twice in one call
    assert bm.owners() == {"b": 2}
    bm.free(b)
    assert bm.num_free == 8 and bm.owners() == {}
    assert bm.allocate(8, "c") == list(range(8))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
