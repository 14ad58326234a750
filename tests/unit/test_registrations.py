"""An engine's registered regions found by address (transfer.core.registrations): the same answers as a scan
of every region, through registrations and removals in any order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from transfer.core.registrations import Registrations


def _holding(regions: dict[int, int], addr: int, nbytes: int) -> tuple[int, int] | None:
    return next(((a, n) for a, n in regions.items() if a <= addr and addr + nbytes <= a + n), None)


def _overlapping(regions: dict[int, int], addr: int, nbytes: int) -> tuple[int, int] | None:
    """The first region the scan meets that overlaps the range."""
    return next(((a, n) for a, n in regions.items() if a < addr + nbytes and addr < a + n), None)


# Disjoint regions: cells of 64 bytes, each region some of one cell's bytes.
_cells = st.dictionaries(st.integers(0, 63), st.tuples(st.integers(0, 63), st.integers(1, 64)), max_size=24)
_ranges = st.lists(st.tuples(st.integers(0, 64 * 64 + 64), st.integers(0, 200)), min_size=1, max_size=30)


@given(_cells, _ranges, st.data())
def test_holding_and_overlapping_agree_with_a_scan_of_every_region(cells, ranges, data):
    book = Registrations()
    plain: dict[int, int] = {}
    for cell, (offset, length) in cells.items():
        base = cell * 64 + offset
        length = min(length, 64 - offset) or 1
        book[base] = plain[base] = length
    for base in data.draw(st.lists(st.sampled_from(sorted(plain) or [0]), max_size=8, unique=True)):
        if base in plain:
            if data.draw(st.booleans()):
                del book[base]
            else:
                assert book.pop(base) == plain[base]
            del plain[base]
    assert dict(book) == plain
    for addr, nbytes in ranges:
        assert book.holding(addr, nbytes) == _holding(plain, addr, nbytes), (addr, nbytes)
        found = book.overlapping(addr, nbytes)
        if not nbytes or _overlapping(plain, addr, nbytes) is None:
            assert found is None, (addr, nbytes)
        else:  # one of those overlapping the range (a scan may meet another first)
            assert found is not None and plain.get(found[0]) == found[1], (addr, nbytes)
            assert found[0] < addr + nbytes and addr < found[0] + found[1], (addr, nbytes)


def test_a_region_registered_again_after_it_went_is_found_and_clear_forgets_every_one():
    book = Registrations()
    book[0x1000] = 0x100
    book[0x3000] = 0x100
    del book[0x1000]
    assert book.holding(0x1010, 16) is None and book.overlapping(0x0f00, 0x200) is None
    book[0x1000] = 0x80
    book.update({0x5000: 0x10})
    assert book.holding(0x1010, 16) == (0x1000, 0x80) and book.holding(0x1078, 16) is None
    assert book.overlapping(0x1078, 16) == (0x1000, 0x80) and book.holding(0x5000, 0x10) == (0x5000, 0x10)
    assert book.setdefault(0x7000, 8) == 8 and book.holding(0x7000, 8) == (0x7000, 8)
    book.clear()
    assert book.holding(0x3000, 1) is None and book.overlapping(0, 1 << 20) is None and not book


def test_every_dict_mutation_keeps_the_sorted_bases_in_step():
    """The look-ups read the sorted bases, then the dict: a base registered again (a new length), popped when absent,
    taken by popitem or set by setdefault that the bases list misses or holds twice would make a look-up find a
    base the dict lacks (a KeyError) or miss a region it has."""
    book = Registrations()
    book[0x1000] = 0x100
    book[0x3000] = 0x100
    book[0x1000] = 0x200  # registered again, a new length: still one base
    assert book.holding(0x1100, 0x100) == (0x1000, 0x200)
    del book[0x1000]
    assert book.holding(0x1010, 16) is None and book.overlapping(0x0f00, 0x200) is None
    assert book.pop(0x2000, None) is None  # absent: nothing else goes
    assert book.holding(0x3000, 0x100) == (0x3000, 0x100)
    assert book.setdefault(0x3000, 8) == 0x100 and book.holding(0x3000, 0x100) == (0x3000, 0x100)
    assert book.popitem() == (0x3000, 0x100)
    assert book.holding(0x3000, 1) is None and book.overlapping(0, 1 << 20) is None and not book
    book[0x3000] = 0x10
    assert book.holding(0x3000, 0x10) == (0x3000, 0x10)
