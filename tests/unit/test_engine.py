"""transfer.engine's pure parts: protocol choice, and poll() against a scripted transfer engine."""

from __future__ import annotations

import pytest
from fakes import MooncakeStandIn, stand_in_mooncake
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transfer import engine as engine_module
from transfer.engine import Engine, EngineError, choose_protocol, rdma_device_names
from transfer.errors import ConfigError


def test_choose_protocol_with_fake_sysfs(tmp_path, monkeypatch):
    assert choose_protocol("auto", str(tmp_path)) == ("tcp", f"no RDMA device under {tmp_path}")
    missing = tmp_path / "absent"
    assert choose_protocol("auto", str(missing))[0] == "tcp"
    (tmp_path / "rxe0").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_device_names(str(tmp_path)) == ["mlx5_0", "rxe0"]
    assert choose_protocol("auto", str(tmp_path)) == ("rdma", "RDMA device(s) mlx5_0, rxe0 found")
    # The module-level root is what Engine() consults.
    monkeypatch.setattr(engine_module, "INFINIBAND_SYSFS", str(tmp_path))
    assert choose_protocol() == ("rdma", "RDMA device(s) mlx5_0, rxe0 found")
    monkeypatch.setattr(engine_module, "INFINIBAND_SYSFS", str(missing))
    assert choose_protocol() == ("tcp", f"no RDMA device under {missing}")


def test_choose_protocol_explicit_and_unknown(tmp_path):
    (tmp_path / "rxe0").mkdir()
    assert choose_protocol("tcp", str(tmp_path)) == ("tcp", "requested")
    assert choose_protocol("rdma", str(tmp_path / "none")) == ("rdma", "requested")
    with pytest.raises(ValueError, match="unknown protocol 'nvlink'"):
        choose_protocol("nvlink")


class _ScriptedTE(MooncakeStandIn):
    """A stand-in for mooncake's TransferEngine whose status answers follow a script (pure logic)."""

    def __init__(self) -> None:
        self.script = [-2, -2, 0, 1]
        self.freed = False

    def batch_transfer_async_write(self, *args) -> int:
        return 77

    def transfer_check_status(self, batch: int) -> int:
        assert batch == 77 and not self.freed, "status asked of a batch Mooncake freed"
        rc = self.script.pop(0)
        self.freed = rc in (1, -1)
        return rc


def test_mooncake_timeout_status_is_a_warning_not_an_outcome(monkeypatch):
    """transfer_check_status answers -2 (TIMEOUT, with MC_SLICE_TIMEOUT set) while the batch is
    still in flight and does not free it: poll() keeps the batch and reports no failure, since the
    caller would then release memory Mooncake goes on reading (Mooncake's own tests call TIMEOUT 'a
    per-poll signal ... not an outcome')."""
    fake = _ScriptedTE()

    stand_in_mooncake(monkeypatch, fake)
    engine = Engine("127.0.0.1", protocol="tcp")
    buf = bytearray(64)
    addr = id(buf)  # any plausible address: the scripted engine reads nothing
    engine.register(addr, 64)
    ticket = engine.write_async("127.0.0.1:1", [addr], [0x1000], [64])
    answers = [engine.poll(ticket) for _ in range(3)]
    assert answers == [False, False, False]
    assert engine.poll(ticket) is True
    assert fake.script == []
    engine.close()


def test_a_write_mooncake_reports_failed_says_what_to_check(monkeypatch):
    """A negative status (a peer gone, or a destination it never registered) names the peer and what to check."""
    fake = _ScriptedTE()
    fake.script = [-1]

    stand_in_mooncake(monkeypatch, fake)
    engine = Engine("127.0.0.1", protocol="tcp")
    buf = bytearray(64)
    engine.register(id(buf), 64)
    ticket = engine.write_async("127.0.0.1:1", [id(buf)], [0x1000], [64])
    with pytest.raises(EngineError) as caught:
        engine.poll(ticket)
    assert str(caught.value) == (
        "write to 127.0.0.1:1 failed (rc=-1): 1 buffer(s), 64 bytes, first destination 0x1000+64; is the peer engine "
        "127.0.0.1:1 still running, and its host and port reachable from this node, and does the destination lie in "
        "memory it registered? (a peer restarted at the same host:port keeps failing here until this process "
        "restarts: docs/operations.md, troubleshooting)")
    engine.close()


def test_a_region_mooncake_would_not_unregister_stays_registered_and_its_tensor_alive(monkeypatch):
    import torch

    class RefusingTE(MooncakeStandIn):
        refuse = True

        def unregister_memory(self, addr: int) -> int:
            return -1 if self.refuse else 0

    fake = RefusingTE()

    stand_in_mooncake(monkeypatch, fake)
    engine = Engine("127.0.0.1", protocol="tcp")
    tensor = torch.zeros(64, dtype=torch.uint8)
    addr, _ = engine.register(tensor)
    with pytest.raises(EngineError, match=r"unregistering address .* failed \(rc=-1\); it stays registered"):
        engine.unregister(addr)
    # Peers may still write there: the memory must outlive the registration.
    assert engine.registered() == {addr: 64} and engine.owner_of(addr, 64) is tensor
    fake.refuse = False
    engine.unregister(addr)
    assert engine.registered() == {} and engine.owner_of(addr, 64) is None
    engine.close()


def test_a_call_on_a_closed_engine_says_what_closed_it_and_what_to_do(monkeypatch):
    class FakeModule:
        TransferEngine = staticmethod(MooncakeStandIn)

    monkeypatch.setattr(engine_module, "_import_engine", lambda: FakeModule)
    engine = Engine("127.0.0.1", protocol="tcp")
    engine.close()
    told = (f"engine {engine.session_id} is closed: its close() ran; start a new engine (and new pools and managers "
            f"on it) to register or write more")
    with pytest.raises(EngineError) as caught:
        engine.register(0x10000, 64)
    assert str(caught.value) == told
    with pytest.raises(EngineError) as caught:
        engine.write_async("127.0.0.1:1", [0x10000], [0x1000], [64])
    assert str(caught.value) == told


@pytest.mark.parametrize("environ, seconds", [
    ({}, 30.0), ({"MC_TRANSFER_TIMEOUT": "40"}, 40.0), ({"MC_TRANSFER_TIMEOUT": "2"}, 5.0),
    ({"MC_TRANSFER_TIMEOUT": "40.5"}, 40.0), ({"MC_TRANSFER_TIMEOUT": " +12 s"}, 12.0),
    ({"MC_TRANSFER_TIMEOUT": "abc"}, 5.0), ({"MC_TRANSFER_TIMEOUT": ""}, 5.0), ({"MC_TRANSFER_TIMEOUT": "-40"}, 5.0),
])
def test_the_transfer_timeout_is_read_as_mooncake_reads_it(environ, seconds):
    """max(5, atoi(MC_TRANSFER_TIMEOUT)) where it is set: the bound our waits for a write keep must be Mooncake's."""
    from transfer.engine import mooncake_transfer_timeout_s

    assert mooncake_transfer_timeout_s(environ) == seconds


def test_a_region_must_end_below_the_top_of_the_address_space(monkeypatch):
    """A range ending at 2**64 or past it is refused as a ConfigError before Mooncake sees it (the
    wire engine's C book stores a region's end in 64 bits, so 2**64 itself does not fit)."""

    class FakeModule:
        TransferEngine = staticmethod(_ScriptedTE)

    monkeypatch.setattr(engine_module, "_import_engine", lambda: FakeModule)
    engine = Engine("127.0.0.1", protocol="tcp")
    for addr, length in (((1 << 64) - 16, 16), ((1 << 64) - 8, 16)):
        with pytest.raises(ConfigError, match=f"cannot register address {addr:#x} with length {length}: not a range"):
            engine.register(addr, length)
    assert engine.register((1 << 64) - 32, 16) == ((1 << 64) - 32, 16)
    assert engine.registered() == {(1 << 64) - 32: 16}


@pytest.mark.parametrize("hostname", ["0.0.0.0", "::", "[::]", "0.0.0.0:17000", "0", "0:17000", "0x0", "::ffff:0.0.0.0"])
def test_a_wildcard_hostname_is_refused_before_mooncake_starts(hostname, monkeypatch):
    # Its session id (hostname:port) goes to every peer, whose writes there would reach their own host.
    monkeypatch.setattr(engine_module, "_import_engine", lambda: pytest.fail("Mooncake was started"))
    with pytest.raises(ConfigError, match=r"is a wildcard address: peers write to the session id .*give this "
                                          r"node's IP address"):
        Engine(hostname)


@pytest.mark.parametrize("src, dst, length, said", [
    (0x1000, [0x2000], [64], r"src_addrs must be a sequence of ints, one per buffer, got int 4096: for one buffer "
                              r"pass \[src\], \[dst\], \[length\]"),
    ([0x1000], 0x2000, [64], r"dst_addrs must be a sequence of ints, one per buffer, got int 8192"),
    ([0x1000], [0x2000], "64", r"lengths must be a sequence of ints, one per buffer, got str '64'"),
    ([0x1000], [0x2000], [64.0], r"buffer 0 is \(source, destination, length\) \(4096, 8192, 64.0\); each must be an "
                                  r"int"),
    ([0x1000, "0x1100"], [0x2000, 0x2100], [64, 64], r"buffer 1 is .*'0x1100'.*; each must be an int"),
])
def test_a_write_given_what_is_no_batch_of_ints_is_refused_naming_it(src, dst, length, said):
    # Mooncake's own calls take one address and one length; a bare len() TypeError said nothing of that.
    with pytest.raises(engine_module.ConfigTypeError, match=rf"^write to 10\.0\.0\.2:17000: {said}"):
        engine_module.check_batch("10.0.0.2:17000", src, dst, length)


def test_a_batch_of_index_like_ints_is_taken_and_zero_lengths_dropped():
    import numpy as np

    assert engine_module.check_batch("p:1", [np.int64(16), 32], (48, np.uint64(64)), [np.int32(8), 0]) == (
        [16], [48], [8])


def _checked(check, *args):
    """('ok', the lists and their items' types) or ('error', exception type, message)."""
    try:
        lists = check("p:1", *args)
    except (ConfigError, TypeError) as exc:
        return "error", type(exc), str(exc)
    return "ok", lists, [[type(item) for item in one] for one in lists]


_ADDRESS_SPACE = 1 << 64
_edge_ints = st.one_of(st.integers(-2, 2), st.integers(0, _ADDRESS_SPACE + 2),
                       st.sampled_from([_ADDRESS_SPACE - 1, _ADDRESS_SPACE, _ADDRESS_SPACE - 64]))
_buffer_items = st.one_of(*[_edge_ints] * 6, st.booleans(), st.just(64.0), st.just("64"))  # mostly ints


@settings(max_examples=500)
@given(st.lists(st.tuples(_buffer_items, _buffer_items, _buffer_items), max_size=3), st.sampled_from([list, tuple]))
@example([(0x1000, _ADDRESS_SPACE - 64, 64)], tuple)  # the destination's last byte is the address space's
@example([(0x1000, _ADDRESS_SPACE - 64, 65)], tuple)  # one past it
@example([(0x1000, 0x2000, 64), (0x1040, 0x2040, 0)], tuple)  # an empty buffer after one to write
@example([(0x1000, 0x2000, 64), (0x1040, 0x2040, True)], list)
@example([(0x1000, -1, 1)], list)  # a destination below the address space
def test_a_plain_batch_checks_as_the_buffer_by_buffer_loop_does(buffers, kind):
    """check_batch's copy of a plain batch of exact ints (none empty, each destination in range) is what its
    buffer-by-buffer loop builds, and any other batch gets what that loop makes of it: the lists, or its error."""
    srcs, dsts, lens = (kind(column) for column in zip(*buffers)) if buffers else (kind(), kind(), kind())
    assert (_checked(engine_module.check_batch, srcs, dsts, lens)
            == _checked(engine_module._checked_batch, srcs, dsts, lens))



def _counted_then_checked(session_id, srcs, dsts, lens):
    """check_batch's rules read the long way for sequences: the counts compared first, then buffer by buffer."""
    if not (len(srcs) == len(dsts) == len(lens)):
        raise ConfigError(f"write to {session_id}: {len(srcs)} sources, {len(dsts)} destinations, {len(lens)} lengths")
    return engine_module._checked_batch(session_id, srcs, dsts, lens)


@settings(max_examples=500)
@given(st.lists(_buffer_items, max_size=3), st.lists(_buffer_items, max_size=3), st.lists(_buffer_items, max_size=3),
       st.sampled_from([list, tuple]))
@example([0x1000, 0x1040], [0x2000], [64], tuple)  # fewer destinations, every buffer plain
@example([0x1000], [0x2000], [64, 64], list)  # more lengths
@example([0x1000, 0x1040], [0x2000, 0x2040], [0], tuple)  # fewer lengths, the first buffer empty
def test_a_plain_batch_of_unequal_counts_is_refused_as_the_counts_say(srcs, dsts, lens, kind):
    """Sources, destinations and lengths given in unequal numbers are refused naming the three counts, whatever
    the buffers hold; equal ones are checked buffer by buffer."""
    srcs, dsts, lens = kind(srcs), kind(dsts), kind(lens)
    assert _checked(engine_module.check_batch, srcs, dsts, lens) == _checked(_counted_then_checked, srcs, dsts, lens)

@pytest.mark.parametrize("environ, first, last, how", [
    ({}, 15000, 17000, "Mooncake's default, MC_MIN_RPC_PORT/MC_MAX_RPC_PORT being unset"),
    ({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20003"}, 20000, 20003,
     "MC_MIN_RPC_PORT 20000 to MC_MAX_RPC_PORT 20003"),
    ({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20003", "MC_MIN_PRC_PORT": "21000",
      "MC_MAX_PRC_PORT": "21003"}, 20000, 20003, "MC_MIN_RPC_PORT 20000 to MC_MAX_RPC_PORT 20003"),
    ({"MC_MIN_PRC_PORT": "21000", "MC_MAX_PRC_PORT": "21003"}, 21000, 21003,
     "MC_MIN_PRC_PORT 21000 to MC_MAX_PRC_PORT 21003"),
    ({"MC_MIN_RPC_PORT": "20000", "MC_MAX_PRC_PORT": "20003"}, 20000, 20003,
     "MC_MIN_RPC_PORT 20000 to MC_MAX_PRC_PORT 20003"),
    ({"MC_MAX_RPC_PORT": "15002"}, 15000, 15002, "the default 15000 to MC_MAX_RPC_PORT 15002"),
    ({"MC_MIN_RPC_PORT": "20005", "MC_MAX_RPC_PORT": "20005"}, 20005, 20005,
     "MC_MIN_RPC_PORT 20005 to MC_MAX_RPC_PORT 20005"),
])
def test_mooncakes_port_range_is_read_as_mooncake_reads_it(environ, first, last, how):
    """Each end from MC_*_RPC_PORT, else MC_*_PRC_PORT, else 15000 / 17000 (as Mooncake 0.3.13 started engines
    on loopback showed)."""
    from transfer.engine import mooncake_port_range

    assert mooncake_port_range(environ, (32768, 60999)) == (first, last, how)


@pytest.mark.parametrize("environ", [
    {"MC_MIN_RPC_PORT": "40000", "MC_MAX_RPC_PORT": "40001"},  # in the ephemeral ports
    {"MC_MIN_RPC_PORT": "32000", "MC_MAX_RPC_PORT": "32768"},  # reaching into them
    {"MC_MIN_RPC_PORT": "60999", "MC_MAX_RPC_PORT": "61001"},
    {"MC_MIN_RPC_PORT": "1023", "MC_MAX_RPC_PORT": "1024"},
    {"MC_MIN_RPC_PORT": "20020", "MC_MAX_RPC_PORT": "20010"},
    {"MC_MIN_RPC_PORT": "abc", "MC_MAX_RPC_PORT": "20010"},
    {"MC_MIN_RPC_PORT": "20000"},  # up to the default 17000: below its start
])
def test_a_port_range_mooncake_refuses_is_its_default_instead(environ):
    from transfer.engine import mooncake_port_range

    first, last, how = mooncake_port_range(environ, (32768, 60999))
    assert (first, last) == (15000, 17000)
    assert how.startswith("Mooncake's default, as ") and "no range it takes" in how and "32768-60999" in how


def test_a_failed_start_with_too_few_free_ports_says_which_range_and_what_to_do():
    from transfer.engine import start_failure_hint

    taken = start_failure_hint("tcp", 20000, 20002, "MC_MIN_RPC_PORT 20000 to MC_MAX_RPC_PORT 20002", 2)
    assert taken.startswith("its RPC and TCP-transport listeners need two free ports of 20000-20002 "
                            "(MC_MIN_RPC_PORT 20000 to MC_MAX_RPC_PORT 20002), and 2 of its 3 ports are in use: ")
    assert "2 or more free ports" in taken and "ss -ltn 'sport >= :20000 and sport <= :20002'" in taken
    single = start_failure_hint("tcp", 20005, 20005, "MC_MIN_RPC_PORT 20005 to MC_MAX_RPC_PORT 20005", 0)
    assert "and the range has only 1 port: " in single and "no single fixed port" in single
    rdma = start_failure_hint("rdma", 20005, 20005, "given", 1)
    assert rdma.startswith("its RPC listener needs a free port of 20005-20005 (given), and 1 of its 1 ports")


@pytest.mark.parametrize("protocol, in_use", [("tcp", 1), ("tcp", None), ("rdma", 2)])
def test_a_failed_start_with_free_ports_left_points_at_mooncakes_log(protocol, in_use):
    """Enough free ports (or a range too long to count): the cause is elsewhere, and Mooncake's log names it."""
    from transfer.engine import start_failure_hint

    hint = start_failure_hint(protocol, 20000, 20002, "given", in_use)
    assert hint == "Mooncake's log lines above say why (its ports come from 20000-20002, given)"


class _BatchingTE(MooncakeStandIn):
    """Mooncake's registrations as a set, with its batch unregistration: it goes on past an address it refuses
    (those in `refuse`) and then answers -1 without naming it; a second unregistration of one answers -3."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.refuse: set[int] = set()
        self.calls: list[tuple[str, int]] = []

    def batch_register_memory(self, addrs: list[int], sizes: list[int]) -> int:
        self.held.update(addrs)
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister_memory", 1))
        return self._drop(addr)

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        self.calls.append(("batch_unregister_memory", len(addrs)))
        rcs = [self._drop(addr) for addr in addrs]
        return next((rc for rc in rcs if rc != 0), 0)

    def _drop(self, addr: int) -> int:
        if addr in self.refuse:
            return -1
        if addr not in self.held:
            return -3
        self.held.discard(addr)
        return 0


def _batching_engine(monkeypatch) -> tuple[Engine, _BatchingTE]:
    fake = _BatchingTE()

    stand_in_mooncake(monkeypatch, fake)
    return Engine("127.0.0.1", protocol="tcp"), fake


def test_many_regions_are_unregistered_in_one_mooncake_call(monkeypatch):
    """Mooncake's unregister_memory rewrites the engine's segment description each time: tens of thousands of
    temporary source registrations dropped one call each held a sender pool's thread for seconds."""
    engine, fake = _batching_engine(monkeypatch)
    bases = [0x10000 + i * 0x1000 for i in range(100)]
    for base in bases:
        engine.register(base, 256)
    assert engine.unregister_many(bases[:60]) == {}
    assert fake.calls == [("batch_unregister_memory", 60)]
    assert sorted(engine.registered()) == bases[60:] and fake.held == set(bases[60:])
    fake.calls.clear()
    engine.close()  # the rest go with one call too
    assert fake.calls == [("batch_unregister_memory", 40)] and fake.held == set()


def test_a_region_mooncakes_batch_refuses_stays_registered_and_the_others_go(monkeypatch):
    import torch

    engine, fake = _batching_engine(monkeypatch)
    tensors = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    first, refused, last = (engine.register(tensor)[0] for tensor in tensors)
    fake.refuse = {refused}
    problems = engine.unregister_many([first, refused, last, 0x999000])
    assert set(problems) == {refused, 0x999000}
    assert "failed (rc=-1); it stays registered" in problems[refused] and "is not registered" in problems[0x999000]
    assert engine.registered() == {refused: 64} and engine.owner_of(refused, 64) is tensors[1]
    assert engine.owner_of(first, 64) is None
    fake.refuse = set()
    engine.close()
    with pytest.raises(EngineError, match="is closed"):
        engine.unregister_many([first])
