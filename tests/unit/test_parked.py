"""Parked asks: admission, eviction and byte accounting."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from transfer.core import parked as parked_module
from transfer.core.parked import ASK_OVERHEAD_BYTES, ParkedAsks, ask_cost


def test_an_ask_costs_its_text_and_a_fixed_part():
    assert ask_cost(_ask(1, "s" * 20)) == len("10.0.0.7") + 20 + len("torch.bfloat16") + ASK_OVERHEAD_BYTES
from transfer.frames import TransferInfo


def _ask(room: int, session: str = "s0", fanout: int = 1, endpoint: str = "10.0.0.7",
         dtype: str = "torch.bfloat16") -> TransferInfo:
    return TransferInfo(room, endpoint, 5000, session, 0x10000, 0, 4, 256, dtype, False, fanout, 0, 4)


def test_asks_of_a_room_collect_by_session_and_a_repeat_replaces():
    parked = ParkedAsks()
    assert not parked.add(_ask(1, "a", fanout=2), now=1.0).refused
    parked.add(_ask(1, "b", fanout=2), now=2.0)
    parked.add(_ask(1, "a", fanout=2, endpoint="10.0.0.77"), now=3.0)  # a's repeat, a longer endpoint
    asks = parked.get(1)
    assert sorted(asks.infos) == ["a", "b"] and asks.first_at == 1.0 and asks.fanout == 2
    assert asks.infos["a"].endpoint == "10.0.0.77"
    assert parked.nbytes == asks.nbytes == ask_cost(asks.infos["a"]) + ask_cost(asks.infos["b"])


def test_take_removes_the_room_and_its_bytes():
    parked = ParkedAsks()
    parked.add(_ask(1), now=0.0)
    parked.add(_ask(2), now=0.0)
    taken = parked.take(1)
    assert taken.room == 1 and 1 not in parked and parked.take(1) is None
    assert parked.nbytes == ask_cost(_ask(2))
    assert [a.room for a in parked.take_all()] == [2] and parked.nbytes == 0 and len(parked) == 0


def test_a_new_room_past_the_room_bound_evicts_the_oldest():
    parked = ParkedAsks(max_rooms=3)
    for room in range(3):  # each of another session: one session's share is a quarter
        parked.add(_ask(room, f"s{room}"), now=float(room))
    admission = parked.add(_ask(3, "s3"), now=3.0)
    assert [a.room for a in admission.evicted] == [0] and parked.rooms() == [1, 2, 3]
    assert parked.nbytes == 3 * ask_cost(_ask(0))


def test_a_receiver_past_the_per_room_bound_is_refused_but_a_repeat_is_not():
    parked = ParkedAsks(max_receivers=2)
    parked.add(_ask(1, "a", fanout=4), now=0.0)
    parked.add(_ask(1, "b", fanout=4), now=0.0)
    assert parked.add(_ask(1, "c", fanout=4), now=0.0).refused
    assert not parked.add(_ask(1, "a", fanout=4), now=0.0).refused
    assert sorted(parked.get(1).infos) == ["a", "b"]


def test_the_byte_bound_evicts_oldest_rooms_but_never_the_one_just_asked():
    budget = 3 * ask_cost(_ask(0, "s" * 20))
    parked = ParkedAsks(max_bytes=budget)
    for room in range(3):
        parked.add(_ask(room, f"s{room:019}"), now=float(room))
    admission = parked.add(_ask(9, f"s{9:019}"), now=9.0)
    assert [a.room for a in admission.evicted] == [0] and parked.nbytes <= budget
    # One room alone over the bound is kept: it is the one being served.
    alone = ParkedAsks(max_bytes=10)
    assert not alone.add(_ask(1), now=0.0).evicted and 1 in alone


def test_the_byte_bound_evicts_an_older_room_than_the_one_asked_even_when_that_one_came_first():
    budget = 3 * ask_cost(_ask(0, "s" * 20))
    parked = ParkedAsks(max_bytes=budget)
    parked.add(_ask(1, "a" * 20), now=0.0)  # room 1 is the oldest
    parked.add(_ask(2, "b" * 20), now=1.0)
    parked.add(_ask(1, "c" * 20), now=2.0)
    admission = parked.add(_ask(1, "d" * 20), now=3.0)  # over the bound: room 2 goes, not room 1
    assert [a.room for a in admission.evicted] == [2]
    assert sorted(parked.get(1).infos) == ["a" * 20, "c" * 20, "d" * 20] and 2 not in parked


def test_rooms_older_than_a_cutoff_in_arrival_order():
    parked = ParkedAsks()
    for room, at in ((5, 1.0), (3, 2.0), (8, 9.0)):
        parked.add(_ask(room), now=at)
    assert parked.older_than(5.0) == [5, 3]


def test_dropping_a_session_removes_its_asks_from_every_room_and_their_bytes():
    parked = ParkedAsks()
    for room in (1, 2):
        parked.add(_ask(room, "dead", fanout=2), now=0.0)
        parked.add(_ask(room, "alive", fanout=2), now=0.0)
    parked.add(_ask(3, "dead"), now=0.0)
    parked.take(2)
    dropped = parked.drop_session("dead")
    assert sorted(i.room for i in dropped) == [1, 3]
    assert parked.rooms() == [1] and list(parked[1].infos) == ["alive"]
    assert parked.nbytes == parked[1].nbytes == ask_cost(_ask(1, "alive", fanout=2))
    assert not parked.has_session("dead") and parked.drop_session("dead") == []


def test_a_session_past_its_share_of_the_rooms_drops_its_own_oldest_ask_not_another_sessions():
    parked = ParkedAsks(max_rooms=8)  # a session's share: 2 rooms
    parked.add(_ask(100, "good", fanout=2), now=0.0)
    parked.add(_ask(0, "flood"), now=1.0)
    parked.add(_ask(1, "flood"), now=2.0)
    admission = parked.add(_ask(2, "flood"), now=3.0)
    assert [(i.room, i.session_id) for i in admission.dropped] == [(0, "flood")] and not admission.evicted
    assert not parked.add(_ask(2, "flood"), now=4.0).dropped, "a repeat takes no new room"
    admission = parked.add(_ask(100, "flood", fanout=2), now=5.0)  # a room of another's: its ask stays
    assert [(i.room, i.session_id) for i in admission.dropped] == [(1, "flood")]
    assert parked.rooms() == [100, 2] and list(parked[100].infos) == ["good", "flood"]
    assert parked.nbytes == sum(asks.nbytes for asks in parked.values())


def test_a_session_past_its_share_of_the_bytes_drops_its_own_oldest_asks_but_never_the_one_just_asked():
    cost = ask_cost(_ask(0, "flood"))
    parked = ParkedAsks(max_bytes=4 * 3 * cost)  # a session's share: 3 asks
    parked.add(_ask(100, "good"), now=0.0)
    for room in range(3):
        assert not parked.add(_ask(room, "flood"), now=1.0).dropped
    admission = parked.add(_ask(3, "flood"), now=2.0)
    assert [i.room for i in admission.dropped] == [0] and not admission.evicted
    big = _ask(4, "flood", endpoint="h" * (4 * cost))
    admission = parked.add(big, now=3.0)
    assert [i.room for i in admission.dropped] == [1, 2, 3] and parked.rooms() == [100, 4]
    assert parked.nbytes == ask_cost(_ask(100, "good")) + ask_cost(big)


_SESSIONS = ("a", "b", "c")
_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.sampled_from(_SESSIONS), st.integers(1, 3),
              st.sampled_from(("10.0.0.7", "10.0.0.777", "10.0.0.8")),
              st.sampled_from(("torch.bfloat16", "torch.int8"))),
    st.tuples(st.just("drop_ask"), st.integers(0, 3), st.sampled_from(_SESSIONS)),
    st.tuples(st.just("drop_session"), st.sampled_from(_SESSIONS)),
    st.tuples(st.just("take"), st.integers(0, 3)),
    st.tuples(st.just("take_all")),
), max_size=60)


@example(ops=[("add", 0, "a", 2, "10.0.0.7", "torch.bfloat16"), ("add", 1, "a", 2, "10.0.0.7", "torch.bfloat16"),
              ("add", 1, "b", 2, "10.0.0.7", "torch.bfloat16"), ("take", 0), ("take", 1)],
         max_rooms=8, max_bytes=20, costs_kept=4096)  # a session in two rooms, taken one by one
@settings(max_examples=300, deadline=None)
@given(ops=_OPS, max_rooms=st.integers(2, 8), max_bytes=st.integers(3, 20), costs_kept=st.integers(1, 4))
def test_each_rooms_fanout_first_ask_and_bytes_stay_those_of_its_parked_asks(ops, max_rooms, max_bytes, costs_kept):
    """Whatever comes and goes (repeats, drops, evictions under tight bounds, all taken at once, asks of a
    session with other endpoints and dtypes, costs kept for few sessions), a room's fanout is its first parked
    ask's, every byte count is the sum of its parked asks' costs, and `get` (the room dict's own) finds exactly
    the rooms parked."""
    kept_before = parked_module.MAX_COSTS_KEPT
    parked_module.MAX_COSTS_KEPT = costs_kept
    try:
        _hold_counts(ops, max_rooms, max_bytes)
    finally:
        parked_module.MAX_COSTS_KEPT = kept_before


def _hold_counts(ops: list, max_rooms: int, max_bytes: int) -> None:
    parked = ParkedAsks(max_rooms=max_rooms, max_bytes=max_bytes * ASK_OVERHEAD_BYTES)
    for now, (op, *args) in enumerate(ops):
        if op == "add":
            room, session, fanout, endpoint, dtype = args
            parked.add(_ask(room, session, fanout=fanout, endpoint=endpoint, dtype=dtype), now=float(now))
        else:
            getattr(parked, op)(*args)
        total = 0
        mine: dict[str, dict[int, int]] = {}  # session -> room -> the cost of its ask parked there
        for asks in parked.values():
            first = next(iter(asks.infos.values()))
            assert (asks.fanout, asks.first) == (first.fanout, first.session_id)
            assert asks.nbytes == sum(ask_cost(info) for info in asks.infos.values())
            total += asks.nbytes
            for session, info in asks.infos.items():
                mine.setdefault(session, {})[asks.room] = ask_cost(info)
        assert parked.nbytes == total
        # Each session's index names exactly the rooms it has an ask in, and their bytes.
        assert {session: (set(m.rooms), m.nbytes) for session, m in parked._by_session.items()} == {
            session: (set(rooms), sum(rooms.values())) for session, rooms in mine.items()}
        assert [parked.get(room) for room in range(4)] == [parked[room] if room in parked else None
                                                            for room in range(4)]


def test_iterating_the_rooms_walks_a_copy_so_rooms_may_be_taken_meanwhile():
    """A sweep takes the rooms it walks (one told Failed, the next looked at): a walk of the live dict would
    raise once the first went, leaving the rest parked past their deadline."""
    parked = ParkedAsks()
    for room in (5, 3, 8):
        parked.add(_ask(room, f"s{room}"), now=float(room))
    walked = []
    for room in parked:
        walked.append(room)
        parked.take(room)
    assert walked == [5, 3, 8] and len(parked) == 0 and parked.nbytes == 0
