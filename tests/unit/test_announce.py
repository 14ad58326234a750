"""The prefill side's region re-announcement (transfer.core.announce)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.core.announce import REANNOUNCE_AFTER, AnnounceBook, Announcements
from transfer.frames import MAX_REGIONS_PER_SESSION


def test_a_region_is_announced_once_then_held():
    book = AnnounceBook()
    assert book.needs("rank0", (0x1000, 0), (64, 0))
    book.announced("rank0", (0x1000, 0), (64, 0))
    assert not book.needs("rank0", (0x1000, 0), (64, 0))
    assert book.needs("rank1", (0x1000, 0), (64, 0)), "each encode rank is told for itself"


def test_a_region_pair_with_another_deepstack_region_is_announced_on_its_own():
    # One embedding buffer with two deepstack buffers: the encode rank must hear of both.
    book = AnnounceBook()
    book.announced("rank0", (0x1000, 0x8000), (64, 128))
    assert book.needs("rank0", (0x1000, 0x9000), (64, 128))
    book.announced("rank0", (0x1000, 0x9000), (64, 128))
    assert not book.needs("rank0", (0x1000, 0x8000), (64, 128))


def test_a_region_of_another_length_at_the_same_address_is_announced_again():
    book = AnnounceBook()
    book.announced("rank0", (0x1000, 0), (64, 0))
    assert book.needs("rank0", (0x1000, 0), (128, 0))


def test_a_region_is_announced_again_once_half_the_window_followed_it():
    known = Announcements()
    known.add((0x1000, 0), (64, 0))
    for i in range(REANNOUNCE_AFTER - 1):
        known.add((0x10000 + i * 64, 0), (64, 0))
    assert known.holds((0x1000, 0), (64, 0)), "still well inside the encode rank's window"
    known.add((0x90000, 0), (64, 0))
    assert not known.holds((0x1000, 0), (64, 0)), "the encode rank may drop it before a room lands"
    assert REANNOUNCE_AFTER == MAX_REGIONS_PER_SESSION // 2


def test_the_book_keeps_no_more_regions_per_rank_than_the_encode_rank_does():
    known = Announcements(window=4, reannounce_after=4)
    for i in range(10):
        known.add((i * 64, 0), (64, 0))
    assert [base for base, _ in known.regions] == [6 * 64, 7 * 64, 8 * 64, 9 * 64]


def test_announcing_a_region_again_moves_it_to_the_newest():
    known = Announcements(window=3, reannounce_after=3)
    known.add((0, 0), (64, 0))
    known.add((64, 0), (64, 0))
    known.add((0, 0), (64, 0))
    known.add((128, 0), (64, 0))
    known.add((192, 0), (64, 0))
    assert (0, 0) in known.regions and (64, 0) not in known.regions


def test_a_withdrawn_or_forgotten_announcement_is_made_again():
    book = AnnounceBook()
    book.announced("rank0", (0x1000, 0), (64, 0))
    book.withdraw("rank0", (0x1000, 0))
    assert book.needs("rank0", (0x1000, 0), (64, 0))
    book.announced("rank0", (0x1000, 0), (64, 0))
    book.announced("rank0", (0x2000, 0), (64, 0))
    book.forget("rank0")
    assert book.needs("rank0", (0x1000, 0), (64, 0)) and book.needs("rank0", (0x2000, 0), (64, 0))
    assert len(book) == 0


REGIONS = st.sampled_from([(0x1000, 0), (0x1000, 0x9000), (0x2000, 0)])
LENGTHS = st.sampled_from([(64, 0), (64, 32), (128, 0)])


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(["announced", "withdraw", "forget"]), st.integers(0, 1), REGIONS, LENGTHS),
                max_size=40), st.integers(1, 4), st.integers(1, 4))
def test_needs_is_what_the_ranks_announcements_hold(ops, window, reannounce_after):
    """needs() reads a rank's announcements itself: a rank never told, or one whose Announcements.holds() says no."""
    book = AnnounceBook(window=window, reannounce_after=reannounce_after)
    for kind, rank, region, lengths in ops:
        if kind == "announced":
            book.announced(rank, region, lengths)
        elif kind == "withdraw":
            book.withdraw(rank, region)
        else:
            book.forget(rank)
        for asked in range(2):
            for other in ((0x1000, 0), (0x1000, 0x9000), (0x2000, 0)):
                for other_lengths in ((64, 0), (64, 32), (128, 0)):
                    known = book._ranks.get(asked)
                    assert book.needs(asked, other, other_lengths) == (
                        known is None or not known.holds(other, other_lengths))


_RANKS = st.sampled_from(["rank0", "rank1"])
_REGIONS = st.tuples(st.sampled_from([0x1000, 0x2000, 0x3000]), st.sampled_from([0, 0x9000]))
_LENGTHS = st.tuples(st.sampled_from([64, 128]), st.sampled_from([0, 256]))
_BOOK_OPS = st.lists(st.one_of(
    st.tuples(st.just("announced"), _RANKS, _REGIONS, _LENGTHS),
    st.tuples(st.just("withdraw"), _RANKS, _REGIONS),
    st.tuples(st.just("forget"), _RANKS),
), max_size=30)


@given(_BOOK_OPS, st.integers(2, 4), _RANKS, _REGIONS, _LENGTHS)
def test_needs_is_what_the_ranks_announcements_hold(ops, window, rank, region, lengths):
    """needs() reads the rank's announcement by key: exactly not Announcements.holds(), True for a rank never told."""
    book = AnnounceBook(window=window, reannounce_after=window // 2)
    for op, *args in [("forget", "nobody"), *ops]:
        getattr(book, op)(*args)
        known = book._ranks.get(rank)
        assert book.needs(rank, region, lengths) == (known is None or not known.holds(region, lengths))
