"""The bench's floor loops in C (native/floor.c, `epd-transfer bench --paths cfloor`): arguments whose
sizes or addresses the loops' arithmetic cannot hold, and waits that are no bound, are refused before
anything is allocated or waited on, whether or not zmq_bind() and mooncake_bind() were called."""

from __future__ import annotations

import math

import pytest

from transfer import _native

U64 = (1 << 64) - 1
SLOT = 1 << 20  # an address the loops never reach: every call here is refused first


def receive(slots=(SLOT,), items=4, deadline_s=1.0, width=8, nbytes=64):
    return _native.floor_receive(1, 1, -1, 0, list(slots), items, deadline_s, width, nbytes)


def serve(receivers=((0, 1, 0, 0, 1),), deadline_s=1.0, poll_min_s=1e-3, poll_max_s=1e-2, base=SLOT, row_bytes=8,
          starts=1):
    return _native.floor_serve(1, 1, -1, list(receivers), 0, deadline_s, poll_min_s, poll_max_s, base, row_bytes,
                               starts, 1, -1)


@pytest.mark.parametrize("items, width", [(4, 1 << 62), (1 << 32, 1 << 31), (3, U64 // 4)])
def test_prints_larger_than_a_bytes_object_are_refused_before_allocating(items, width):
    """items * 2 * width wrapped: (4, 2**62) made a 0-byte prints buffer that the loop then wrote
    2 * 2**62 bytes a room into."""
    with pytest.raises(ValueError, match=rf"^floor_receive: {items} rooms' prints of 2 x {width} bytes each exceed "
                                         r"the largest bytes object \(9223372036854775807 bytes\)$"):
        receive(items=items, width=width, nbytes=U64)


@pytest.mark.parametrize("slot, nbytes", [(0, 64), (U64 - 7, 16), (1 << 63, 1 << 63)])
def test_a_slot_that_is_no_range_of_the_address_space_is_refused(slot, nbytes):
    with pytest.raises(ValueError, match=rf"^floor_receive: slot 1 \(0x{slot:x}\+{nbytes}\) is not a range of the "
                                         r"address space$"):
        receive(slots=(SLOT, slot), nbytes=nbytes)


@pytest.mark.parametrize("rows, row_start, row_bytes, base, starts", [
    (1 << 62, 0, 8, SLOT, 1),  # rows * row_bytes wraps
    (1, U64, 8, SLOT, 1),  # row_start + rows wraps
    (1, 1, 8, U64 - 16, 2),  # the last start's source ends past 2**64 (receiver 0's does not)
    (U64 // 2, 0, 2, SLOT, 1),  # fits 64 bits, not once the base is added
])
def test_a_receiver_whose_source_ranges_run_past_the_address_space_is_refused(rows, row_start, row_bytes, base,
                                                                               starts):
    with pytest.raises(ValueError, match=rf"^floor_serve: receiver 1's writes \({rows} rows of {row_bytes} bytes "
                                         rf"from row {row_start}, {starts} starts, base 0x{base:x}\) run past the "
                                         r"64-bit address space$"):
        serve(receivers=((0, 1, 0, 0, 1), (1, 1, 0, row_start, rows)), row_bytes=row_bytes, base=base,
              starts=starts)


@pytest.mark.parametrize("starts", [0, (1 << 31) + 1, 1 << 62])
def test_starts_past_what_the_offset_arithmetic_holds_are_refused(starts):
    """A room's start is (room % starts) * (step % starts) % starts in int64: past 2**31 starts the
    product can overflow."""
    with pytest.raises(ValueError, match=r"^floor_serve: 1 to 64 receivers, starts in 1\.\.2147483648 and until "
                                         r">= 0$"):
        serve(starts=starts, base=0, row_bytes=1)


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -math.inf, -1.0, 1e10])
@pytest.mark.parametrize("call, named", [
    (lambda s: receive(deadline_s=s), "floor_receive: deadline_s"),
    (lambda s: serve(deadline_s=s), "floor_serve: deadline_s"),
    (lambda s: serve(poll_min_s=s), "floor_serve: poll_min_s"),
    (lambda s: serve(poll_max_s=s), "floor_serve: poll_max_s"),
])
def test_a_wait_that_is_no_bound_is_refused(call, named, seconds):
    """NaN never passes the loops' deadline check, and converting it (or an infinity) to a timespec is
    undefined: the loop would wait for ever or for an arbitrary time."""
    with pytest.raises(ValueError, match=rf"^{named} must be a number of seconds in 0\.\.1e\+09, got "):
        call(seconds)


@pytest.mark.parametrize("receiver, error, message", [
    (b"not a tuple", TypeError, r"^floor_serve: receiver 1 must be a tuple \(rank, push handle, segment, row_start, "
                                r"rows\), not bytes$"),
    ((1, 1, 0, 0), TypeError, r"^floor_serve: receiver 1 must be a tuple .*, not tuple$"),
    ([1, 1, 0, 0, 1], TypeError, r"^floor_serve: receiver 1 must be a tuple .*, not list$"),
    ((1.5, 1, 0, 0, 1), TypeError, r"^floor_serve: receiver 1's rank must be an int64, got 1\.5$"),
    ((1 << 63, 1, 0, 0, 1), ValueError, r"^floor_serve: receiver 1's rank must be an int64, got 9223372036854775808$"),
    ((1, 1, -1, 0, 1), ValueError, r"^floor_serve: receiver 1's segment must be an int in 0\.\.18446744073709551615, "
                                   r"got -1$"),
    ((1, 1, 0, -1, 1), ValueError, r"^floor_serve: receiver 1's row_start must be an int in 0\.\."),
    ((1, 1, 0, 0, -1), ValueError, r"^floor_serve: receiver 1's rows must be an int in 0\.\."),
])
def test_a_receiver_that_is_no_five_tuple_of_integers_in_range_is_refused_naming_it(receiver, error, message):
    """Each receiver was parsed with PyArg_ParseTuple's "LOKKK": a non-tuple raised SystemError ("new style
    getargs format but argument is not a tuple"), and "K" read a negative rows or row_start as its low 64
    bits (rows -1 with row_bytes 1 from base 0 passed as 2**64 - 1 rows)."""
    with pytest.raises(error, match=message):
        serve(receivers=((0, 1, 0, 0, 1), receiver), base=0, row_bytes=1)


@pytest.mark.parametrize("call, named", [
    (lambda: serve(base=-SLOT), "floor_serve: base"),
    (lambda: serve(row_bytes=-8), "floor_serve: row_bytes"),
    (lambda: receive(width=-8), "floor_receive: width"),
    (lambda: receive(nbytes=-64), "floor_receive: nbytes"),
    (lambda: receive(width=8, nbytes=1 << 64), "floor_receive: nbytes"),
])
def test_a_negative_or_too_large_size_or_address_is_refused_not_wrapped(call, named):
    """"K" kept the low 64 bits of each: -8 passed as 2**64 - 8."""
    with pytest.raises(ValueError, match=rf"^{named} must be an int in 0\.\.18446744073709551615, got "):
        call()
