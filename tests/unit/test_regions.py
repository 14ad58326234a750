"""The region book: announced regions per session, bounded, reset by a new session manager."""

from __future__ import annotations

import tracemalloc

from hypothesis import example, given, settings
from hypothesis import strategies as st

from transfer.core.regions import MAX_REGIONS_PER_SESSION, RegionBook
from transfer.frames import (Registration, TransferInfo, check_region, parse_registration, receiver_text,
                             registration_frames)

SESSION = "10.0.0.7:17000"


def _reg(port: int, base: int, length: int | None = 4096, session: str = SESSION) -> Registration:
    return Registration("10.0.0.7", port, session, base, 0, length, None if length is None else 0)


def _ask(ptr: int, rows: int = 4, session: str = SESSION) -> TransferInfo:
    return TransferInfo(1, "10.0.0.7", 5000, session, ptr, 0, rows, 256, "torch.bfloat16", False, 1, 0, rows)


def _check(book: RegionBook, info: TransferInfo) -> str | None:
    return book.check([info], 512, 0)


def test_regions_accumulate_per_manager_and_reset_for_a_new_one():
    book = RegionBook()
    book.register(_reg(5000, 0x10000))
    book.register(_reg(5000, 0x80000))  # a per-item buffer of the same manager
    assert _check(book, _ask(0x10000)) is None and _check(book, _ask(0x80000)) is None
    reason = _check(book, _ask(0x40000))
    assert reason is not None and "outside registered region" in reason and "room 1" in reason
    assert _check(book, _ask(0x10000 + 4096 - 512, rows=2)) is not None  # runs past the end
    book.register(_reg(5001, 0x200000))  # a new status endpoint: a new manager
    assert _check(book, _ask(0x10000)) is not None and _check(book, _ask(0x200000)) is None
    assert len(book.regions(SESSION)) == 1


def test_a_repeat_of_the_same_base_replaces_it():
    book = RegionBook()
    book.register(_reg(5000, 0x10000, 4096))
    book.register(_reg(5000, 0x10000, 8192))
    assert [r.embedding_len for r in book.regions(SESSION)] == [8192]
    assert _check(book, _ask(0x10000 + 4096, rows=4)) is None


def test_one_embedding_region_with_two_deepstack_regions_keeps_both():
    book = RegionBook()
    for ds_base in (0x80000, 0x90000):
        book.register(Registration("10.0.0.7", 5000, SESSION, 0x10000, ds_base, 4096, 4096))

    def ask(ds_ptr: int) -> TransferInfo:
        return TransferInfo(1, "10.0.0.7", 5000, SESSION, 0x10000, ds_ptr, 4, 256, "torch.bfloat16", True, 1, 0, 4)

    assert book.check([ask(0x80000)], 512, 1024) is None
    assert book.check([ask(0x90000)], 512, 1024) is None
    assert book.check([ask(0xA0000)], 512, 1024) is not None
    assert len(book.regions(SESSION)) == 2


def test_regions_per_session_are_bounded_newest_kept():
    book = RegionBook()
    for index in range(MAX_REGIONS_PER_SESSION + 10):
        book.register(_reg(5000, 0x100000 * (index + 1)))
    assert len(book.regions(SESSION)) == MAX_REGIONS_PER_SESSION
    assert _check(book, _ask(0x100000)) is not None
    assert _check(book, _ask(0x100000 * (MAX_REGIONS_PER_SESSION + 10))) is None


def test_sessions_are_bounded_least_recently_used_first():
    book = RegionBook(max_sessions=8)
    for index in range(8):
        book.register(_reg(5000, 0x10000, session=f"s{index}"))
    book.register(_reg(5000, 0x10000, session="s0"))  # registered again
    assert book.check([_ask(0x10000, session="s1")], 512, 0) is None  # written to
    book.register(_reg(5000, 0x10000, session="s8"))
    book.register(_reg(5000, 0x10000, session="s9"))
    assert len(book) == 8
    assert "s0" in book and "s1" in book and "s2" not in book and "s3" not in book and "s9" in book


def test_a_session_that_never_registered_or_gave_no_lengths_is_written_as_peers_do():
    book = RegionBook()
    assert _check(book, _ask(0xDEAD0000)) is None
    book.register(_reg(5000, 0x10000, length=None))
    assert _check(book, _ask(0xDEAD0000)) is None


def test_deepstack_destinations_are_checked_against_their_own_length():
    book = RegionBook()
    book.register(Registration("10.0.0.7", 5000, SESSION, 0x10000, 0x90000, 4096, 1024))
    info = TransferInfo(1, "10.0.0.7", 5000, SESSION, 0x10000, 0x90000, 4, 256, "torch.bfloat16", True, 1, 0, 4)
    assert book.check([info], 512, 256) is None
    reason = book.check([info], 512, 512)  # 2048 deepstack bytes into a 1024-byte region
    assert reason is not None and "deepstack" in reason


def test_a_region_announced_past_the_address_space_holds_no_destination_that_wraps():
    # A destination past 2**64 is written at the bottom of the address space, outside the region; nor would the
    # destination book see it overlap another room's write there.
    top = (1 << 64) - 4096
    book = RegionBook()
    book.register(Registration("10.0.0.7", 5000, SESSION, top, top, 1 << 20, 1 << 20))
    assert _check(book, _ask(top, rows=8)) is None  # 4096 bytes: the region's last
    reason = _check(book, _ask(top, rows=9))
    assert reason is not None and "outside registered region" in reason
    assert _check(book, _ask(top + 512, rows=8)) is not None
    deep = TransferInfo(1, "10.0.0.7", 5000, SESSION, top, top + 256, 8, 256, "torch.bfloat16", True, 1, 0, 8)
    assert book.check([deep], 512, 32) is None
    reason = book.check([deep], 512, 512)
    assert reason is not None and "deepstack" in reason


def test_once_a_session_announced_lengths_a_registration_without_them_is_refused():
    book = RegionBook()
    assert book.register(_reg(5000, 0x10000)) is None
    reason = book.register(_reg(5000, 0x80000, length=None))
    assert reason is not None and "without region lengths" in reason and SESSION in reason
    assert [r.embedding_base for r in book.regions(SESSION)] == [0x10000]
    assert _check(book, _ask(0x80000)) is not None
    assert book.register(_reg(5001, 0x80000, length=None)) is not None  # from a new status endpoint too


def test_a_registration_without_lengths_cannot_switch_the_check_off_in_any_order():
    book = RegionBook()
    book.register(_reg(5000, 0x80000, length=None))  # a peer-style registration first
    book.register(_reg(5000, 0x10000))
    reason = _check(book, _ask(0x80000))
    assert reason is not None and "outside registered region" in reason
    assert _check(book, _ask(0x10000)) is None


def test_eviction_forgets_sessions_without_lengths_before_those_that_announced_them():
    book = RegionBook(max_sessions=2)
    book.register(_reg(5000, 0x10000, session="announced"))
    for index in range(4):
        book.register(_reg(5000, 0x10000, length=None, session=f"peer{index}"))
    assert "announced" in book and len(book) == 2
    assert book.check([_ask(0x900000, session="announced")], 512, 0) is not None


def test_a_session_that_announced_lengths_is_refused_once_superseded_until_it_registers_again():
    book = RegionBook()
    book.register(_reg(5000, 0x10000))
    book.forget(SESSION, "session 10.0.0.7:18000 at the same status endpoint superseded it")
    reason = _check(book, _ask(0xDEAD0000))
    assert reason is not None and "superseded it" in reason and "no destination of it is accepted" in reason
    assert _check(book, _ask(0x10000)) is not None
    book.register(_reg(5000, 0x10000))
    assert _check(book, _ask(0x10000)) is None


def test_a_served_session_evicted_after_announcing_lengths_is_refused_not_written_unchecked():
    book = RegionBook(max_sessions=2)
    for session in (SESSION, "other0"):
        book.register(_reg(5000, 0x10000, session=session))
        book.served(session)
    book.register(_reg(5000, 0x10000, session="other1"))
    assert SESSION not in book
    reason = _check(book, _ask(0xDEAD0000))
    assert reason is not None and "forgotten for newer sessions (more than 2)" in reason
    book.forget("never-registered")
    assert _check(book, _ask(0xDEAD0000, session="never-registered")) is None, "never announced: as the peers do"


def test_eviction_reaches_sessions_served_a_write_only_after_those_never_served():
    book = RegionBook(max_sessions=3)
    book.register(_reg(5000, 0x10000))
    book.served(SESSION)
    for index in range(10):  # sessions of a peer that registers and is never served
        book.register(_reg(5000, 0x10000, session=f"flood{index}"))
    assert SESSION in book and len(book) == 3
    assert _check(book, _ask(0xDEAD0000)) is not None, "its regions are still checked"
    # Those pushed out are forgotten, not retired: asks naming them are written as a peer's are.
    assert "flood0" not in book and _check(book, _ask(0xDEAD0000, session="flood0")) is None


def test_a_refusal_quotes_the_peers_endpoint_as_one_printable_bounded_line():
    # The refusal is logged: a status endpoint a peer made up must not forge log lines (a newline, a
    # carriage return, a terminal escape) nor make a 10 KiB one.
    hostile = ("10.0.0.7\nWARNING transfer: forged\r\x1b[31m" + "x" * (10 << 10)).encode("ascii")
    frames = registration_frames("10.0.0.7", 5000, SESSION, 0x10000, 0, 4096, 0)
    book = RegionBook()
    assert book.register(parse_registration(frames)) is None
    frames = registration_frames("10.0.0.7", 5000, SESSION, 0x80000, 0)
    frames[1] = hostile
    reason = book.register(parse_registration(frames))
    assert reason is not None and "without region lengths" in reason
    assert reason.isprintable() and "\x1b" not in reason and len(reason) < 512, (len(reason), reason[:200])


def test_a_sessions_regions_hold_its_long_session_id_and_endpoint_once():
    """Each registration a peer sends brings its own copies of its texts; kept per region, a peer's
    64 KiB messages would hold per_session times what it sent for each of its sessions."""
    text = 16 << 10
    session, endpoint = "s" * text, "e" * text
    book = RegionBook()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(MAX_REGIONS_PER_SESSION):
            book.register(parse_registration(registration_frames(endpoint, 5000, session, 0x10000 * (i + 1), 0,
                                                                 4096, 0)))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(book.regions(session)) == MAX_REGIONS_PER_SESSION
    assert held < 4 * 2 * text, f"{held} bytes held for {MAX_REGIONS_PER_SESSION} regions of one session"
    assert _check(book, _ask(0x10000 * MAX_REGIONS_PER_SESSION, session=session)) is None


class _StrictBook(RegionBook):
    """check() as it reads with every region's reason collected and the session filed again through _use()."""

    def check(self, infos, row_bytes, deepstack_row_bytes):
        for info in infos:
            session = self._sessions.pop(info.session_id, None)
            if session is None:
                why = self._retired.get(info.session_id)
                if why is not None:
                    return (f"room {info.room}: receiver {receiver_text(info.session_id)} announced its regions "
                            f"with lengths before, but {why}: no destination of it is accepted until it registers "
                            f"again")
                continue
            self._sessions[info.session_id] = session
            self._use(info.session_id, session)
            if not session.announced:
                continue
            reasons = [check_region(info, reg, row_bytes, deepstack_row_bytes) for reg in session.regs]
            if reasons and all(reasons):
                return reasons[-1]
        return None


_SESSIONS = ("a:1", "a:2", "b:1")
_REGION_STEPS = st.lists(st.one_of(
    st.tuples(st.just("register"), st.sampled_from(_SESSIONS), st.integers(0, 1), st.sampled_from([0, 4096, 8192]),
              st.sampled_from([None, 1024, 4096]), st.sampled_from([None, 0, 2048])),
    st.tuples(st.just("served"), st.sampled_from(_SESSIONS)),
    st.tuples(st.just("forget"), st.sampled_from(_SESSIONS)),
    st.tuples(st.just("check"), st.lists(st.tuples(st.sampled_from(_SESSIONS), st.sampled_from([0, 1024, 4096, 9000]),
                                                   st.integers(0, 4), st.booleans()), max_size=3)),
), max_size=40)


@example([("register", "a:1", 0, 0, 4096, None), ("register", "a:2", 0, 0, None, None),
          ("check", [("a:1", 0, 2, False), ("a:2", 9000, 1, False)]), ("register", "b:1", 0, 0, 4096, 0)], 2, 2)
@settings(max_examples=300)
@given(steps=_REGION_STEPS, max_sessions=st.integers(1, 3), per_session=st.integers(1, 3))
def test_a_check_answers_and_files_sessions_as_one_reading_every_region_through_use(steps, max_sessions, per_session):
    def run(book: RegionBook) -> list:
        seen: list = []
        for step in steps:
            if step[0] == "register":
                _, session, port, base, length, deepstack_length = step
                seen.append(book.register(Registration("10.0.0.7", 6000 + port, session, base, 0x10_0000 + base,
                                                       length, deepstack_length if length is not None else None)))
            elif step[0] == "check":
                infos = [TransferInfo(1, "10.0.0.7", 5000, session, ptr, 0x10_0000 + ptr, rows, 256, "torch.bfloat16",
                                      deepstack, 1, 0, rows) for session, ptr, rows, deepstack in step[1]]
                seen.append(book.check(infos, 256, 128))
            else:
                getattr(book, step[0])(step[1])
            seen.append((book.sessions(), [list(order) for order in book._order], dict(book._retired), book.version,
                         {s: (book._sessions[s].filed, book._sessions[s].kind) for s in book.sessions()}))
        return seen

    assert (run(RegionBook(max_sessions=max_sessions, per_session=per_session))
            == run(_StrictBook(max_sessions=max_sessions, per_session=per_session)))


def test_retired_sessions_are_bounded_by_max_sessions_the_oldest_forgotten_first():
    """Retired sessions are refused until they register again; a peer superseding sessions by the thousand must
    not grow that memory past max_sessions, so the oldest retired one is forgotten first (its asks are then
    written as a session that never announced lengths would be)."""
    book = RegionBook(max_sessions=2)
    for session in ("s0", "s1", "s2"):
        book.register(_reg(5000, 0x10000, session=session))
        book.forget(session, "it was superseded")
    assert _check(book, _ask(0xDEAD0000, session="s0")) is None, "forgotten: written as the peers do"
    for session in ("s1", "s2"):
        reason = _check(book, _ask(0xDEAD0000, session=session))
        assert reason is not None and "superseded" in reason
