"""The prefill façade's own checks that need no engine: a deepstack destination's row width and element type, and
what a destination tensor may be (transfer.receiver)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.errors import ConfigError
from transfer.core.quarantine import Fate
from transfer.receiver import _deepstack_row_bytes, _destination, _settle

BF16 = "torch.bfloat16"


def width(dst, rows: int, deepstack_hidden: int | None = None, dtype: str = BF16) -> int | None:
    nbytes = dst[1] if isinstance(dst, tuple) else dst.numel() * dst.element_size()
    return _deepstack_row_bytes(7, dst, nbytes, rows, dtype, deepstack_hidden)


def test_the_width_is_the_destinations_bytes_per_row():
    assert width(torch.empty(4, 96, dtype=torch.bfloat16), 4) == 192
    assert width((0x10000, 4 * 192), 4) == 192
    assert width(torch.empty(4 * 96, dtype=torch.bfloat16), 4) == 192  # flat: whole rows all the same
    assert width(torch.empty(4, 96, dtype=torch.bfloat16), 4, deepstack_hidden=96) == 192


def test_an_empty_shard_takes_its_width_from_a_2d_tensor_or_sends_none():
    assert width(torch.empty(0, 96, dtype=torch.bfloat16), 0) == 192
    assert width(torch.empty(0, 96, dtype=torch.bfloat16), 0, deepstack_hidden=96) == 192
    assert width((0x10000, 0), 0, deepstack_hidden=48) == 96
    assert width((0x10000, 0), 0) is None  # nothing tells it, and nothing is written there


@pytest.mark.parametrize("dst, rows, deepstack_hidden, message", [
    ((0x10000, 4 * 192), 4, 64, "room 7: deepstack destination of 768 bytes does not hold 4 rows of deepstack_hidden "
                                "64 x torch.bfloat16 (512 bytes)"),
    ((0x10000, 4 * 192), 4, 128, "room 7: deepstack destination of 768 bytes does not hold 4 rows of "
                                 "deepstack_hidden 128 x torch.bfloat16 (1024 bytes)"),
    ((0x10000, 4 * 192 + 2), 4, None, "room 7: deepstack destination of 770 bytes is not 4 rows of whole "
                                      "torch.bfloat16 elements (give deepstack_hidden to say its width)"),
    ((0x10000, 4 * 3), 4, None, "room 7: deepstack destination of 12 bytes is not 4 rows of whole torch.bfloat16 "
                                "elements (give deepstack_hidden to say its width)"),
    ((0x10000, 0), 4, None, "room 7: deepstack destination of 0 bytes is not 4 rows of whole torch.bfloat16 "
                            "elements (give deepstack_hidden to say its width)"),
    ((0x10000, 768), 4, 0, "room 7: deepstack_hidden must be a positive integer, got 0"),
    ((0x10000, 768), 4, True, "room 7: deepstack_hidden must be a positive integer, got True"),
])
def test_a_destination_that_does_not_hold_exactly_its_rows_is_refused(dst, rows, deepstack_hidden, message):
    with pytest.raises(ConfigError) as caught:
        width(dst, rows, deepstack_hidden)
    assert str(caught.value) == message


@pytest.mark.parametrize("dst, rows, deepstack_hidden, message", [
    (torch.empty(4, 48, dtype=torch.float32), 4, None,
     "room 7: deepstack destination dtype torch.float32 != item dtype torch.bfloat16 (deepstack rows are of the "
     "item's dtype)"),
    (torch.empty(4 * 48, dtype=torch.float32), 4, 96,
     "room 7: deepstack destination dtype torch.float32 != item dtype torch.bfloat16 (deepstack rows are of the "
     "item's dtype)"),
    (torch.empty(2, 192, dtype=torch.bfloat16), 4, None, "room 7: deepstack destination of shape (2, 192) is not 4 rows"),
    (torch.empty(2, 32, dtype=torch.bfloat16), 4, 16,
     "room 7: deepstack destination of shape (2, 32) is not 4 rows of deepstack_hidden 16"),
])
def test_a_deepstack_tensor_of_another_dtype_or_shape_is_refused_though_its_bytes_fit(dst, rows, deepstack_hidden,
                                                                                      message):
    """Its bytes would land as they are and be read as other values: a Success with wrong numbers."""
    with pytest.raises(ConfigError) as caught:
        width(dst, rows, deepstack_hidden)
    assert str(caught.value) == message


def test_a_destination_tensor_of_a_dtype_the_wire_has_no_name_for_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^unknown dtype torch.complex64"):
        _destination(torch.empty(2, 4, dtype=torch.complex64), None, None, None)


def test_a_lazily_negated_destination_is_refused():
    tensor = torch.zeros(1, 1, dtype=torch.complex64).conj().imag  # its memory holds the values' negation
    assert tensor.is_neg() and tensor.is_contiguous()
    with pytest.raises(ConfigError, match="lazily negated or conjugated view"):
        _destination(tensor, None, None, None)


SIZES = st.one_of(st.integers(-2, 3), st.sampled_from([True, False, 1.0, None, "1"]))


@settings(max_examples=500, deadline=None)
@given(SIZES, SIZES, SIZES, SIZES, SIZES)
def test_geometry_is_checked_size_by_size_in_the_order_named(rows, hidden, span, row_start, deepstack_hidden):
    """A receive's sizes are refused as each one's own check refuses it, the first in order named."""
    from transfer.frames import size_problem
    from transfer.receiver import _check_geometry

    problems = [size_problem(name, value, least) for name, value, least in (
        ("rows", rows, 0), ("hidden", hidden, 1), ("span", span, 0), ("row_start", row_start, 0),
        ("deepstack_hidden", deepstack_hidden, 0))]
    first = next((problem for problem in problems if problem), None)
    if first is None and row_start + rows > span:
        first = f"shard [{row_start}, {row_start + rows}) outside the item's span {span}"
    if first is None:
        _check_geometry(7, rows, hidden, span, row_start, deepstack_hidden)
    else:
        with pytest.raises(ConfigError) as refused:
            _check_geometry(7, rows, hidden, span, row_start, deepstack_hidden)
        assert str(refused.value) == f"room 7: {first}"


class _Lease:
    """A pool slot's two ways out, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def release(self, event=None) -> None:
        self.calls.append(("release", event))

    def fail(self) -> None:
        self.calls.append(("fail",))


@pytest.mark.parametrize("fate", list(Fate))
@pytest.mark.parametrize("event", [None, "copy-out event"])
def test_a_slots_fate_is_carried_out_as_its_quarantined_property_says(fate, event):
    """_settle() tells Fate.FREE by identity before asking `quarantined`: every fate ends as that property
    says (fail() when quarantined, else release(), with the event only after a copy-out)."""
    lease = _Lease()
    _settle(lease, fate, event)
    if fate.quarantined:
        assert lease.calls == [("fail",)]
    else:
        assert lease.calls == [("release", event if fate is Fate.FREE_AFTER_COPY else None)]


# ------------------------------------------- plain tensors told by their type

def _tensor(draw_shape, dtype, kind):
    """A destination of `kind`: plain, transposed, a lazily negated or conjugated view, a Parameter."""
    tensor = torch.zeros(draw_shape, dtype=dtype)
    if kind == "transposed" and tensor.dim() >= 2:
        return tensor.transpose(0, 1)
    if kind == "negated" and not dtype.is_complex and dtype is not torch.bool:
        return torch._neg_view(tensor)
    if kind == "conjugated" and dtype.is_complex:
        return tensor.conj()
    if kind == "imaginary" and dtype.is_complex:
        return tensor.conj().imag  # negated
    if kind == "parameter":
        return torch.nn.Parameter(tensor, requires_grad=False)
    return tensor


TENSORS = st.builds(_tensor, st.lists(st.integers(0, 3), max_size=3).map(tuple),
                    st.sampled_from([torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.complex64]),
                    st.sampled_from(["plain", "transposed", "negated", "conjugated", "imaginary", "parameter"]))
GIVEN = st.one_of(st.none(), st.integers(0, 4), st.sampled_from([True, 2.0]))
GIVEN_DTYPE = st.sampled_from([None, BF16, "torch.float32", "torch.int64"])


def _as_the_rules_read(monkeypatch, call, *args):
    """What `call` makes of its arguments with no tensor type told, as the rules read them, and as the shortcut
    does once the type is told: ('ok', result) or ('error', type, text)."""
    from transfer import frames

    outcomes = []
    for told in (None, torch.Tensor):
        monkeypatch.setattr(frames, "torch_tensor", told)
        try:
            result = call(*args)
        except Exception as exc:  # noqa: BLE001 - the refusal is compared, type and text
            outcomes.append(("error", type(exc), str(exc)))
        else:
            outcomes.append(("ok", [(type(value), id(value) if isinstance(value, torch.Tensor) else value)
                                    for value in (result if isinstance(result, tuple) else (result,))]))
    return outcomes


@settings(max_examples=300, deadline=None)
@given(TENSORS, GIVEN, GIVEN, GIVEN_DTYPE)
def test_a_plain_destination_tensor_told_by_its_type_is_read_as_the_checks_read_it(dst, rows, hidden, dtype):
    with pytest.MonkeyPatch.context() as monkeypatch:
        slow, fast = _as_the_rules_read(monkeypatch, _destination, dst, rows, hidden, dtype)
    assert fast == slow


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(TENSORS, st.just(torch.tensor(3)), st.just(torch.tensor(True)), GIVEN), max_size=4))
def test_scalar_ints_leave_a_plain_tensor_told_by_its_type_as_scalar_int_does(values):
    from transfer.frames import scalar_ints

    with pytest.MonkeyPatch.context() as monkeypatch:
        slow, fast = _as_the_rules_read(monkeypatch, scalar_ints, *values)
    assert fast == slow


def test_a_receive_handle_holds_what_room_handle_init_would_set():
    from types import SimpleNamespace

    from transfer import _io
    from transfer.drive.prefill import Room
    from transfer.receiver import ReceiveHandle
    from transfer.status import RoomTable

    driver = SimpleNamespace(table=RoomTable(), conclusions=_io.Conclusions(), rooms={})
    manager = SimpleNamespace(_driver=driver, _closed=True)  # closed: the dropped handle warns of nothing
    record = Room(7, 1.0, 64)
    handle = ReceiveHandle(manager, record, shard=(0, 4))
    reference = _io.RoomHandle(driver.table, record, driver.conclusions, driver.rooms.get)
    assert {name: value for name, value in vars(handle).items() if name in vars(reference)} == vars(reference)
    assert handle.shard == (0, 4) and handle._manager is manager


def _region_manager(sets):
    """A SessionManager holding `sets` (the first its main set), with a driver stand-in that only reads the clock."""
    from types import SimpleNamespace

    from transfer.receiver import SessionManager

    manager = SessionManager.__new__(SessionManager)
    manager._region_sets, manager.buffer = sets, sets[0].embedding
    manager._driver = SimpleNamespace(clock=lambda: 1.0)
    return manager


def _outcome(call):
    try:
        return "ok", call()
    except ConfigError as exc:
        return "error", str(exc)


@settings(max_examples=500, deadline=None)
@given(main=st.tuples(st.integers(0, 4096), st.integers(0, 4096)), leased=st.booleans(),
       others=st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 4096), st.booleans()), max_size=2),
       ptr=st.integers(0, 8192), rows=st.integers(0, 8), hidden=st.integers(1, 64),
       deepstack=st.none() | st.integers(0, 8192), main_deepstack=st.booleans())
def test_a_destination_lands_in_the_region_set_regions_for_finds(main, leased, others, ptr, rows, hidden, deepstack,
                                                                main_deepstack):
    from transfer._io import Region
    from transfer.receiver import RegionSet

    sets = [RegionSet(Region(*main), Region(*main) if main_deepstack else None, leased=leased),
            *(RegionSet(Region(addr, nbytes), Region(addr, nbytes), leased=pool) for addr, nbytes, pool in others)]
    manager = _region_manager(sets)
    ds = None if deepstack is None else (deepstack, rows * 4)  # rows of two bfloat16 elements
    found = _outcome(lambda: manager._room(7, "127.0.0.1:1", ptr, rows=rows, hidden=hidden, dtype="torch.bfloat16",
                                           row_start=0, span=None, deepstack_dst=ds, deepstack_hidden=None,
                                           lease=None)[1].regions)
    assert found == _outcome(lambda: manager._regions_for(7, ptr, rows * hidden * 2, *(ds or (0, 0)), ds is not None))
