"""transfer._io.send_ask: a prefill rank's ask encoded by native/ask.c (`ask_frames`, `ask_send`) goes out as
the very parts TransferInfo.to_frames() makes, and an ask the native encoder does not take goes through
to_frames() and send_frames(). No socket is made: the sends run against test_send_frames' stand-in libzmq."""

from __future__ import annotations

import dataclasses
import errno

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_frames_shortcuts import FIELD_VALUES, I64_MAX, I64_MIN, INFO, U64_MAX, outcome, typed
from test_send_frames import FakeLibzmq, whole

from transfer import _io, _native
from transfer.frames import TransferInfo

EAGAIN = errno.EAGAIN


def native_frames(info: object) -> object:
    """The native encoder's parts of `info` after checking they are to_frames()'s (None: not a plain ask)."""
    native = _native.ask_frames(info, TransferInfo)
    if native is not None:
        assert ("ok", typed(native)) == outcome(info.to_frames)
    return native


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=1000)
@given(st.data())
def test_what_the_native_encoder_takes_it_encodes_as_to_frames(data):
    names = data.draw(st.sets(st.sampled_from(sorted(FIELD_VALUES)), max_size=4))
    native_frames(dataclasses.replace(INFO, **{name: data.draw(FIELD_VALUES[name]) for name in names}))


ascii_text = st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=40)
signed = st.integers(I64_MIN, I64_MAX)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=1000)
@given(room=st.integers(0, I64_MAX), endpoint=ascii_text, port=st.integers(0, 0xFFFF), session=ascii_text,
       emb=st.integers(0, U64_MAX), ds=st.integers(0, U64_MAX), rows=signed, hidden=signed,
       dtype=st.sampled_from(["torch.bfloat16", "torch.float16", "torch.float32", ""]) | ascii_text,
       has_ds=st.booleans(), fanout=signed, row_start=signed, span=signed,
       width=st.none() | st.integers(0, I64_MAX))
def test_every_plain_ask_is_encoded_natively(room, endpoint, port, session, emb, ds, rows, hidden, dtype, has_ds,
                                             fanout, row_start, span, width):
    info = TransferInfo(room, endpoint, port, session, emb, ds, rows, hidden, dtype, has_ds, fanout, row_start, span,
                        width)
    assert native_frames(info) is not None


@pytest.mark.parametrize("value", [0, 1, -1, 9, 10, 99, 100, I64_MAX, I64_MIN, I64_MIN + 1, 10**18, -(10**18)])
def test_each_number_is_its_decimal_text(value):
    info = dataclasses.replace(INFO, rows=value, span=value, fanout=value, row_start=value, hidden=value)
    assert native_frames(info) is not None


def test_an_instance_of_another_class_is_left_to_to_frames():
    class Ask(TransferInfo):
        """A subclass may read its fields otherwise."""

    ask = Ask(*(getattr(INFO, f.name) for f in dataclasses.fields(INFO)))
    assert _native.ask_frames(ask, TransferInfo) is None
    assert _native.ask_frames(object(), TransferInfo) is None


class _Socket:
    underlying = 1  # the handle the stand-in libzmq is called with


@pytest.fixture
def fake_libzmq():
    """Binds the native path to a FakeLibzmq (refusing the calls given); the real libzmq is bound again after."""
    if _io._NATIVE is None:
        pytest.fail("the native ZMQ path did not bind (transfer._native built? libzmq 4?)")

    def bind(refuse: dict[int, int]) -> FakeLibzmq:
        fake = FakeLibzmq(refuse)
        _io._NATIVE.zmq_bind(*fake.addresses())
        return fake

    yield bind
    assert _io._native_parts() is _io._NATIVE


@pytest.mark.parametrize("info", [INFO, dataclasses.replace(INFO, deepstack_row_bytes=16384),
                                  dataclasses.replace(INFO, has_deepstack=1),  # not a plain ask: to_frames()
                                  dataclasses.replace(INFO, endpoint="café")])  # the strict encoder's error
def test_send_ask_sends_to_frames_parts(info, fake_libzmq):
    fake = fake_libzmq({})
    expected = outcome(info.to_frames)
    try:
        _io.send_ask(_Socket(), info)
    except Exception as exc:  # noqa: BLE001 - the strict encoder's error, nothing sent
        assert expected[0] == "error" and str(exc) == expected[2] and fake.calls == []
        return
    assert fake.calls == whole(info.to_frames())


@pytest.mark.parametrize("refused, sent", [(0, 1), (1, 13), (12, 13)])
def test_send_ask_refused_as_send_frames_is(refused, sent, fake_libzmq):
    fake = fake_libzmq({refused: EAGAIN})
    with pytest.raises(_io.zmq.Again):
        _io.send_ask(_Socket(), INFO)
    assert fake.calls == whole(INFO.to_frames())[:sent]


def test_each_field_the_encoder_read_is_held_while_it_looks_up_the_next():
    """A key of the info's dict that is compared with Python code (a str subclass colliding with a field's name)
    may change the dict in the middle of the lookups: the fields read before stay what they were read as, and
    the memory of a value the dict let go of is never read."""
    info = dataclasses.replace(INFO, room=int("1099511627776"))  # made at run time: the dict holds its only ref
    fields = info.__dict__
    armed, kept = [], []

    class Colliding(str):
        def __hash__(self):
            return hash("endpoint")

        def __eq__(self, other):
            if armed:
                fields["room"] = 7  # drops the room the encoder read just before
                kept.append(int("2199023255552"))  # an int of the same size, made where the room was
            return False

    endpoint = fields.pop("endpoint")
    fields[Colliding("x")] = 0  # takes the slot "endpoint" left, so its lookup meets this key first
    fields["endpoint"] = endpoint
    armed.append(True)
    frames = _native.ask_frames(info, TransferInfo)
    assert kept, "the lookup of 'endpoint' did not compare the colliding key"
    assert frames is not None and frames[0] == b"1099511627776"
