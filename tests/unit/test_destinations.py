"""transfer.core.destinations: the ranges writes queued or in flight hold, per session, and overlaps."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.core.destinations import DestinationBook, Held, Overlap


def test_another_rooms_overlapping_range_is_found_and_touching_ones_are_not():
    book = DestinationBook()
    book.hold("s", 1, [(100, 200)])
    assert book.overlap("s", 2, 150, 250) == Overlap(1, 100, 200)
    assert book.overlap("s", 2, 50, 101) == Overlap(1, 100, 200)
    assert book.overlap("s", 2, 200, 300) is None and book.overlap("s", 2, 0, 100) is None


def test_a_range_of_the_same_room_or_of_another_session_is_no_overlap():
    book = DestinationBook()
    book.hold("s", 1, [(100, 200)])
    assert book.overlap("s", 1, 100, 200) is None  # another send of the same room (a retry)
    assert book.overlap("t", 2, 100, 200) is None


def test_a_long_range_held_before_many_short_ones_is_still_found():
    book = DestinationBook()
    book.hold("s", 1, [(0, 10_000)])
    for start in range(20_000, 30_000, 100):
        book.hold("s", 2, [(start, start + 10)])
    assert book.overlap("s", 3, 9_990, 9_995) == Overlap(1, 0, 10_000)


def test_freed_ranges_no_longer_overlap_and_a_session_holding_none_is_forgotten():
    book = DestinationBook()
    first = book.hold("s", 1, [(0, 10), (50, 60)])
    second = book.hold("s", 2, [(20, 30)])
    book.free("s", first)
    assert book.overlap("s", 3, 0, 60) == Overlap(2, 20, 30) and len(book) == 1
    book.free("s", second)
    assert book.overlap("s", 3, 0, 60) is None and len(book) == 0
    book.free("s", second)  # a session forgotten already: nothing to do


_ranges = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 25)).map(lambda r: (r[0], r[0] + r[1])),
                   min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("hold"), st.sampled_from("ab"), st.integers(0, 4), _ranges),
                          st.tuples(st.just("free"), st.integers(0, 30))), max_size=40),
       st.sampled_from("ab"), st.integers(0, 4), st.integers(0, 80), st.integers(1, 30))
def test_overlaps_are_exactly_another_rooms_held_ranges_that_intersect(steps, session, room, start, length):
    book, model, held = DestinationBook(), [], []  # model: (session, room, start, end) held
    for step in steps:
        if step[0] == "hold":
            _, who, number, ranges = step
            entries = [(who, number, s, e) for s, e in ranges]
            held.append((who, book.hold(who, number, ranges), entries))
            model.extend(entries)
        elif held:
            who, handle, entries = held.pop(step[1] % len(held))
            book.free(who, handle)
            for entry in entries:
                model.remove(entry)
    end = start + length
    found = book.overlap(session, room, start, end)
    rivals = {(r, s, e) for who, r, s, e in model if who == session and r != room and s < end and e > start}
    if rivals:
        assert found is not None and (found.room, found.start, found.end) in rivals
    else:
        assert found is None
    assert len(book) == len({who for who, *_ in model})


def test_quarantined_ranges_stay_held_until_their_time_and_then_go():
    book = DestinationBook()
    held = book.hold("s", 1, [(100, 200), (300, 400)])
    book.quarantine("s", held, until=50.0)
    assert book.overlap("s", 2, 150, 160) == Overlap(1, 100, 200, 50.0)
    book.expire(49.9)
    assert book.overlap("s", 2, 350, 360) == Overlap(1, 300, 400, 50.0)
    book.expire(50.0)
    assert book.overlap("s", 2, 0, 1_000) is None and len(book) == 0


def test_a_range_in_flight_has_no_quarantine_end_and_expiring_leaves_it():
    book = DestinationBook()
    book.hold("s", 1, [(100, 200)])
    book.quarantine("s", book.hold("s", 3, [(500, 600)]), until=10.0)
    book.expire(1e9)
    assert book.overlap("s", 2, 150, 160) == Overlap(1, 100, 200, None)


def test_past_the_quarantine_limit_the_oldest_quarantined_ranges_go_first():
    book = DestinationBook(quarantine_limit=2)
    for room in range(3):
        book.quarantine("s", book.hold("s", room, [(room * 10, room * 10 + 10)]), until=100.0 + room)
    assert book.overlap("s", 9, 0, 10) is None
    assert book.overlap("s", 9, 10, 20) == Overlap(1, 10, 20, 101.0)
    assert book.overlap("s", 9, 20, 30) == Overlap(2, 20, 30, 102.0)
    assert book.quarantined == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("hold"), st.sampled_from("ab"), st.integers(0, 4), _ranges),
                          st.tuples(st.sampled_from(["free", "quarantine"]), st.integers(0, 30))), max_size=40),
       st.sampled_from("ab"), st.integers(0, 4), st.integers(0, 80), st.integers(1, 30))
def test_a_range_freed_leaves_the_book_and_its_quarantine_whether_it_was_quarantined_or_not(steps, session, room,
                                                                                             start, length):
    book = DestinationBook()
    held: list[tuple[str, tuple, list, bool]] = []  # (session, what hold() returned, its entries, quarantined)
    for step in steps:
        if step[0] == "hold":
            _, who, number, ranges = step
            held.append((who, book.hold(who, number, ranges), [(who, number, s, e) for s, e in ranges], False))
        elif held:
            i = step[1] % len(held)
            who, handle, entries, quarantined = held[i]
            if step[0] == "free":
                book.free(who, handle)
                del held[i]
            elif not quarantined:
                book.quarantine(who, handle, until=100.0)
                held[i] = (who, handle, entries, True)
    assert book.quarantined == sum(len(handle) for _, handle, _, quarantined in held if quarantined)
    end = start + length
    found = book.overlap(session, room, start, end)
    rivals = {(r, s, e, 100.0 if quarantined else None) for _, _, entries, quarantined in held
              for who, r, s, e in entries if who == session and r != room and s < end and e > start}
    assert (found is None) if not rivals else (found is not None and tuple(found) in rivals)
    book.expire(100.0)
    assert book.quarantined == 0


@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 20)), max_size=6))
def test_a_hold_answers_held_ranges_as_the_named_tuple_builds_them(spans):
    book = DestinationBook()
    ranges = [(start, start + length) for start, length in spans]
    held = book.hold("s", 1, ranges)
    assert [type(one) for one in held] == [Held] * len(ranges)
    assert held == tuple(Held(start, end, seq) for (start, end), seq in zip(ranges, range(1, len(ranges) + 1)))
    assert [(one.start, one.end, one.seq) for one in held] == [(start, end, one.seq) for (start, end), one in
                                                                zip(ranges, held)]


class StrictBook(DestinationBook):
    """DestinationBook with free() letting go of each range through _free_one(), its session looked up each time."""

    def free(self, session: str, held: tuple[Held, ...]) -> None:
        for one in held:
            self._quarantined.pop(one.seq, None)
            self._free_one(session, one)


def _state(book: DestinationBook) -> tuple:
    return ({session: (list(entry.spans), entry.longest) for session, entry in book._sessions.items()},
            list(book._quarantined.items()))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("hold"), st.sampled_from("ab"), st.integers(0, 4), _ranges),
                          st.tuples(st.sampled_from(["free", "free again", "quarantine"]), st.integers(0, 30)),
                          st.tuples(st.just("expire"), st.integers(0, 3))), max_size=40),
       st.integers(1, 4))
def test_free_leaves_the_book_as_freeing_each_range_alone_does(steps, limit):
    books = DestinationBook(quarantine_limit=limit), StrictBook(quarantine_limit=limit)
    held: list[tuple[str, tuple, tuple]] = []  # (session, each book's hold(), ...)
    for step in steps:
        if step[0] == "hold":
            _, who, number, ranges = step
            held.append((who, *(book.hold(who, number, ranges) for book in books)))
        elif step[0] == "expire":
            for book in books:
                book.expire(float(step[1]))
        elif held:
            i = step[1] % len(held)
            who, *handles = held[i]
            for book, handle in zip(books, handles):
                if step[0] == "quarantine":
                    book.quarantine(who, handle, until=float(i % 4))
                else:
                    book.free(who, handle)
            if step[0] == "free":
                del held[i]
        assert _state(books[0]) == _state(books[1])
