"""SPEC.md 8, "Never pickle": no frame, message or HTTP body is ever unpickled or evaluated.

Each parser is fed a live pickle whose loading calls `_loaded` (the first test shows the
payload does run when unpickled), and an expression that would do the same if evaluated;
each must refuse or read them as plain bytes, and nothing may have run."""

from __future__ import annotations

import pickle

import pytest

from transfer import wire
from transfer.bootstrap import _parse_registration, _RequestError
from transfer.frames import (
    TransferInfo,
    WireError,
    is_cancel,
    is_registration,
    parse_cancel,
    parse_cancel_reply,
    parse_failure_reason,
    parse_registration,
    parse_status,
)

RAN: list[str] = []


def _loaded(marker: str) -> str:
    RAN.append(marker)
    return marker


class _Payload:
    def __reduce__(self):
        return _loaded, ("unpickled",)


PICKLED = pickle.dumps(_Payload(), protocol=pickle.HIGHEST_PROTOCOL)
EVALUATED = f"__import__('{__name__}')._loaded('evaluated')".encode()
HOSTILE = [PICKLED, EVALUATED]


@pytest.fixture(autouse=True)
def _nothing_ran():
    RAN.clear()
    yield
    assert RAN == [], f"a hostile input was unpickled or evaluated: {RAN}"


def test_the_payloads_run_when_unpickled_or_evaluated():
    assert pickle.loads(PICKLED) == "unpickled"
    assert eval(EVALUATED) == "evaluated"  # noqa: S307 - shows the payload is live
    assert RAN == ["unpickled", "evaluated"]
    RAN.clear()


@pytest.mark.parametrize("part", HOSTILE)
@pytest.mark.parametrize("index", range(13))
def test_a_transfer_info_part_is_never_unpickled_or_evaluated(part, index):
    frames = [b"7", b"h", b"1", b"s", b"\0" * 8, b"\0" * 8, b"1", b"1", b"torch.bfloat16", b"0", b"1", b"0", b"1"]
    frames[index] = part
    try:
        info = TransferInfo.from_frames(frames)
    except WireError:
        return
    assert part in (info.endpoint.encode(), info.session_id.encode(), info.dtype.encode()) or index == 9


@pytest.mark.parametrize("part", HOSTILE)
def test_extension_parts_are_never_unpickled_or_evaluated(part):
    info = [b"7", b"h", b"1", b"s", b"\0" * 8, b"\0" * 8, b"1", b"1", b"torch.bfloat16", b"0", b"1", b"0", b"1"]
    assert TransferInfo.from_frames([*info, part]).deepstack_row_bytes is None
    registration = [b"None", b"h", b"1", b"s", b"\0" * 8, b"\0" * 8]
    assert is_registration(registration)
    for extra in ([part], [b"1", part]):
        with pytest.raises(WireError):
            parse_registration(registration + extra)
    status = [b"7", b"0", b"0"]
    for extra in ([part], [part, part], [b"failure", part, part]):
        try:
            parse_status(status + extra)
        except WireError:
            pass
        assert parse_cancel_reply(status + extra) is None
        parse_failure_reason(status + extra)
    cancel = [b"Cancel", b"7", b"h", b"1", b"s"]
    assert is_cancel(cancel)
    assert not parse_cancel([*cancel, part]).reads_write_failed


@pytest.mark.parametrize("part", HOSTILE)
@pytest.mark.parametrize("index", range(3))
def test_a_status_part_is_never_unpickled_or_evaluated(part, index):
    frames = [b"7", b"5", b"0"]
    frames[index] = part
    with pytest.raises(WireError):
        parse_status(frames)


@pytest.mark.parametrize("body", [*HOSTILE, b'{"role": "Prefill", "world_size": ' + EVALUATED + b"}"])
def test_a_bootstrap_body_is_never_unpickled_or_evaluated(body):
    with pytest.raises(_RequestError) as refused:
        _parse_registration(body)
    assert refused.value.status == 400


@pytest.mark.parametrize("data", [*HOSTILE, b"k=" + EVALUATED + b"\n\n" + PICKLED, b"\n" + PICKLED])
def test_a_wire_message_is_never_unpickled_or_evaluated(data):
    try:
        msg = wire.Msg.decode(data)
    except wire.MsgError:
        return
    assert msg.body in (data, PICKLED) or msg.get("k") == EVALUATED.decode()
    with pytest.raises(wire.MsgError):
        msg.number("k")
