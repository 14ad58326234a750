"""When an Engine calls Mooncake from C (transfer.engine.direct_calls_verdict), and the native
calls' refusals before any engine exists."""

from __future__ import annotations

import weakref

import pytest

from transfer import _native
from transfer.engine import DIRECT_CALLS_CHECKED, direct_calls_verdict

CHECKED_NAME, (CHECKED_VERSION, *_) = next(iter(DIRECT_CALLS_CHECKED.items()))


def test_the_checked_wheel_alone_gets_the_direct_calls():
    ok, why = direct_calls_verdict({CHECKED_NAME: CHECKED_VERSION}, wanted=True, has_pointer=True)
    assert ok and why == f"{CHECKED_NAME} {CHECKED_VERSION}"


@pytest.mark.parametrize("installed, wanted, has_pointer, reason", [
    ({CHECKED_NAME: CHECKED_VERSION}, False, True, "EPD_MOONCAKE_DIRECT=0"),
    ({CHECKED_NAME: CHECKED_VERSION}, True, False, "no get_engine_ptr"),
    ({}, True, True, "none of the Mooncake wheels"),
    ({CHECKED_NAME: "0.3.14"}, True, True, f"{CHECKED_NAME} 0.3.14 is not a version"),
    ({CHECKED_NAME: CHECKED_VERSION + ".1"}, True, True, "is not a version"),
    ({"mooncake-transfer-engine-cuda13": CHECKED_VERSION}, True, True, "is not a version"),
    ({CHECKED_NAME: CHECKED_VERSION, "mooncake-transfer-engine": CHECKED_VERSION}, True, True,
     "two Mooncake wheels installed"),
])
def test_anything_else_goes_through_the_binding_and_says_why(installed, wanted, has_pointer, reason):
    ok, why = direct_calls_verdict(installed, wanted=wanted, has_pointer=has_pointer)
    assert not ok
    assert reason in why


def test_binding_refuses_a_library_that_is_not_loaded():
    with pytest.raises(OSError, match="is not loaded"):
        _native.mooncake_bind("/nonexistent/engine.so")


def test_binding_refuses_a_loaded_library_without_mooncakes_methods():
    with pytest.raises(OSError, match="has no _ZN8mooncake14TransferEngine"):
        _native.mooncake_bind(_native.__file__)


@pytest.mark.parametrize("call, args", [
    (_native.mooncake_write, (1, 2, 3, 4)),
    (_native.mooncake_check, (1,)),
    (_native.mooncake_settle, (1,)),
])
def test_the_hot_calls_count_their_arguments(call, args):
    with pytest.raises(TypeError, match="takes"):
        call(*args)


@pytest.mark.parametrize("batches", [(1, 2), None, 7, type("Batches", (list,), {})([1])])
def test_settle_takes_a_writes_batches_as_a_list_only(batches):
    """It takes the batches over off the list it is given: a tuple, or a list of another type, is refused
    before Mooncake is asked anything."""
    with pytest.raises(TypeError, match="the batches must be a list"):
        _native.mooncake_settle(1, batches)


@pytest.fixture
def bound():
    """The direct calls bound to the installed Mooncake library; no engine is made (the calls below are refused
    before one would be asked anything)."""
    mooncake_engine = pytest.importorskip("mooncake.engine")
    _native.mooncake_bind(mooncake_engine.__file__)


def test_settle_quotes_a_batch_out_of_range_while_it_still_holds_it(bound):
    """A batch read through its __index__ may drop the list's reference to itself: the error that quotes it
    quotes a live object, not the memory it left."""
    batches, quoted = [], []

    class Batch:
        def __index__(self):
            batches.clear()
            return -1

        def __repr__(self):
            quoted.append(alive() is self)
            return "Batch()"

    batches.append(Batch())
    alive = weakref.ref(batches[0])
    with pytest.raises(ValueError, match=r"^batch must be an int in 0\.\.18446744073709551615, got Batch\(\)$"):
        _native.mooncake_settle(1, batches)
    assert quoted == [True]


@pytest.mark.parametrize("change", ["clear", "insert"])
def test_settle_refuses_a_batch_whose_reading_changed_the_list_before_mooncake_is_asked(bound, change):
    """The batch taken off the list must be the batch checked: when reading the first batch changed the list,
    nothing is asked of Mooncake (the engine here is no engine) and nothing is taken off."""
    batches = []

    class Batch:
        def __index__(self):
            if change == "clear":
                batches.clear()
            else:
                batches.insert(0, 5)
            return 4

    batches.append(Batch())
    with pytest.raises(RuntimeError, match="^mooncake_settle: the batches list changed while a batch was read$"):
        _native.mooncake_settle(1, batches)
    assert batches[:1] == ([] if change == "clear" else [5])
    assert len(batches) == (0 if change == "clear" else 2)
