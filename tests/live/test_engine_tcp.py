"""transfer.engine over a real Mooncake engine (protocol tcp on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from fakes import on_lazy_device

from transfer import engine as engine_module
from transfer.engine import Engine, TransferError, rdma_device_names
from transfer.errors import EngineError


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import mooncake.engine  # noqa: F401
    _MOONCAKE_MISSING = ""
except ImportError as _error:
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

live = [pytest.mark.live,
        pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")]


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    """n reproducible random bytes as a uint8 tensor."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)


@pytest.fixture(scope="module")
def _engines():
    """Two tcp engines shared by the module (closing one takes Mooncake about a second)."""
    with Engine("127.0.0.1", protocol="tcp") as writer, Engine("127.0.0.1", protocol="tcp") as reader:
        yield writer, reader


@pytest.fixture
def pair(_engines):
    """(writer, reader), with no memory registered before or after the test."""
    for engine in _engines:
        assert engine.registered() == {}
    yield _engines
    for engine in _engines:
        for addr in engine.registered():
            engine.unregister(addr)


def _engine_error_in_subprocess(setup: str) -> str:
    """Run Engine() in a fresh interpreter after `setup`; return the EngineUnavailable text."""
    script = textwrap.dedent(setup) + textwrap.dedent("""
        from transfer.engine import Engine, EngineUnavailable
        try:
            Engine(protocol="tcp")
        except EngineUnavailable as error:
            print("UNAVAILABLE:", error)
        else:
            print("STARTED")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("UNAVAILABLE: "), result.stdout + result.stderr
    return line[len("UNAVAILABLE: "):]


def _assert_one_wheel(message: str) -> None:
    """The message names exactly the wheel for this host, and the Debian packages."""
    if engine_module._cuda_host():
        assert "pip install mooncake-transfer-engine " in message
        assert "non-cuda" not in message and "epd-transfer[cuda]" in message
    else:
        assert "pip install mooncake-transfer-engine-non-cuda" in message
        assert "pip install mooncake-transfer-engine " not in message
        assert "epd-transfer[cpu]" in message
    assert "apt-get install libibverbs1 libnuma1" in message


def test_missing_mooncake_names_the_wheel():
    message = _engine_error_in_subprocess("import sys; sys.modules['mooncake'] = None\n")
    assert "mooncake module is not installed" in message
    _assert_one_wheel(message)


def test_missing_libibverbs_names_the_debian_packages():
    message = _engine_error_in_subprocess("""
        import sys

        class NoVerbs:
            def find_spec(self, name, path=None, target=None):
                if name == "mooncake.engine":
                    raise ImportError("libibverbs.so.1: cannot open shared object file: "
                                      "No such file or directory")
                return None

        sys.meta_path.insert(0, NoVerbs())
    """)
    assert "system library" in message and "libibverbs.so.1" in message
    _assert_one_wheel(message)


def _live(test):
    """Apply the live marks (and the skip when mooncake is missing)."""
    for mark in live:
        test = mark(test)
    return test


@_live
def test_session_id_format(pair):
    writer, reader = pair
    for engine in pair:
        assert engine.protocol == "tcp" and engine.hostname == "127.0.0.1"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", engine.session_id)
        assert engine.session_id == f"127.0.0.1:{engine.rpc_port}" and engine.rpc_port > 0
    assert writer.session_id != reader.session_id


@_live
def test_batch_write_lands_exact_bytes(pair):
    writer, reader = pair
    src = _random_bytes(64 * 1024, seed=1)
    dst = torch.zeros(64 * 1024, dtype=torch.uint8)
    writer.register(src)
    reader.register(dst)
    # (source offset, destination offset, length): several buffers, one zero-length.
    pieces = [(0, 1000, 5000), (10000, 20000, 7), (30000, 0, 0), (40000, 50000, 4096),
              (60000, 60000, 5536)]
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    writer.write(reader.session_id, [base_s + s for s, _, _ in pieces],
                 [base_d + d for _, d, _ in pieces], [n for _, _, n in pieces])
    expected = torch.zeros_like(dst)
    for s, d, n in pieces:
        expected[d:d + n] = src[s:s + n]
    assert torch.equal(dst, expected)  # every piece landed, nothing else was touched


@_live
def test_large_single_write(pair):
    writer, reader = pair
    src = _random_bytes(8 << 20, seed=2)
    dst = torch.zeros(8 << 20, dtype=torch.uint8)
    writer.register(src)
    reader.register(dst)
    writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [src.nbytes])
    assert torch.equal(dst, src)


@_live
def test_register_by_address_and_bf16_rows(pair):
    writer, reader = pair
    rows = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    landing = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert writer.register(rows.data_ptr(), rows.nbytes) == (rows.data_ptr(), rows.nbytes)
    reader.register(landing)
    row_bytes = 64 * 2
    # Rows 4..11 of the source land at rows 20..27 of the destination.
    writer.write(reader.session_id, [rows.data_ptr() + 4 * row_bytes],
                 [landing.data_ptr() + 20 * row_bytes], [8 * row_bytes])
    assert torch.equal(landing[20:28], rows[4:12])
    assert not landing[:20].any() and not landing[28:].any()


@_live
def test_concurrent_writes_from_threads(pair):
    writer, reader = pair
    chunk, count = 256 * 1024, 8
    src = _random_bytes(chunk * count, seed=4)
    dst = torch.zeros(chunk * count, dtype=torch.uint8)
    writer.register(src)
    reader.register(dst)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            off = i * chunk
            writer.write(reader.session_id, [src.data_ptr() + off], [dst.data_ptr() + off], [chunk])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert torch.equal(dst, src)


@_live
def test_async_write_and_wait(pair):
    writer, reader = pair
    src = _random_bytes(4096, seed=5)
    dst = torch.zeros(8192, dtype=torch.uint8)
    writer.register(src)
    reader.register(dst)
    batch = writer.write_async(reader.session_id, [src.data_ptr(), src.data_ptr() + 100],
                               [dst.data_ptr() + 4096, dst.data_ptr()], [1000, 50])
    writer.wait(batch, timeout_s=30)
    assert torch.equal(dst[4096:5096], src[:1000])
    assert torch.equal(dst[:50], src[100:150])
    assert not dst[50:4096].any() and not dst[5096:].any()
    batch = writer.write_async(reader.session_id, [src.data_ptr()], [dst.data_ptr() + 6000], [10])
    writer.wait(batch)
    assert torch.equal(dst[6000:6010], src[:10])
    assert writer.write_async(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [0]) == 0


@_live
def test_write_to_dead_session_names_it(pair):
    writer, reader = pair
    src = _random_bytes(1024, seed=6)
    writer.register(src)
    with Engine("127.0.0.1", protocol="tcp") as doomed:
        landing = torch.zeros(1024, dtype=torch.uint8)
        doomed.register(landing)
        dead = doomed.session_id
        writer.write(dead, [src.data_ptr()], [landing.data_ptr()], [1024])  # warm the handle
    with pytest.raises(TransferError, match=re.escape(f"write to {dead} failed")) as caught:
        writer.write(dead, [src.data_ptr()], [landing.data_ptr()], [1024])
    assert "1024 bytes" in str(caught.value) and "rc=" in str(caught.value)
    never = "127.0.0.1:1"
    with pytest.raises(TransferError, match=re.escape(f"write to {never} failed")):
        writer.write(never, [src.data_ptr()], [landing.data_ptr()], [16])
    with pytest.raises(TransferError, match=re.escape(never)):
        writer.write_async(never, [src.data_ptr()], [landing.data_ptr()], [16])


@_live
def test_a_refused_submit_says_so_and_shortens_a_long_session_name(pair):
    writer, _ = pair
    src = _random_bytes(64, seed=7)
    writer.register(src)
    long_name = "h" * 5000  # a peer's TransferInfo can carry any session id
    with pytest.raises(TransferError) as caught:
        writer.write_async(long_name, [src.data_ptr()], [0x10000], [64])
    message = str(caught.value)
    assert "Mooncake refused the batch" in message and "rc=0" not in message
    assert f"{'h' * 100}... (5000 characters) failed" in message and len(message) < 400


@_live
def test_write_outside_peer_region_fails_and_touches_nothing(pair):
    writer, reader = pair
    src = _random_bytes(4096, seed=7)
    dst = torch.zeros(4096, dtype=torch.uint8)
    guard = torch.zeros(4096, dtype=torch.uint8)  # unregistered memory of the reader
    writer.register(src)
    reader.register(dst)
    with pytest.raises(TransferError, match=re.escape(f"write to {reader.session_id} failed")):
        writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr() + 4000], [200])
    with pytest.raises(TransferError, match="200 bytes"):
        writer.write(reader.session_id, [src.data_ptr()], [guard.data_ptr()], [200])
    assert not dst.any() and not guard.any()


@_live
def test_unregistered_source_is_refused(pair):
    writer, reader = pair
    src = _random_bytes(64, seed=8)
    dst = torch.zeros(64, dtype=torch.uint8)
    reader.register(dst)
    with pytest.raises(TransferError, match="is not inside memory registered"):
        writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [64])
    writer.register(src)
    with pytest.raises(TransferError, match="is not inside memory registered"):
        writer.write(reader.session_id, [src.data_ptr() + 32], [dst.data_ptr()], [64])
    assert not dst.any()


@_live
def test_empty_and_malformed_batches(pair):
    writer, _ = pair
    writer.write("127.0.0.1:1", [], [], [])  # nothing to write: no Mooncake call, no error
    writer.write("127.0.0.1:1", [123], [456], [0])
    with pytest.raises(ValueError, match="2 sources, 1 destinations"):
        writer.write("127.0.0.1:1", [1, 2], [3], [4, 5])
    with pytest.raises(ValueError, match="negative length"):
        writer.write("127.0.0.1:1", [1], [3], [-4])


@_live
def test_registration_rules(pair):
    engine, _ = pair
    buf = torch.zeros(1024, dtype=torch.uint8)
    addr, length = engine.register(buf)
    assert (addr, length) == (buf.data_ptr(), 1024)
    assert engine.registered() == {addr: 1024}
    with pytest.raises(TransferError, match=f"0x{addr:x} is already registered"):
        engine.register(buf)
    inner = buf[100:200]
    with pytest.raises(TransferError, match=rf"0x{inner.data_ptr():x} length 100 .*rc="):
        engine.register(inner)  # overlaps the registered region
    with pytest.raises(ValueError, match="non-contiguous"):
        engine.register(torch.zeros(8, 8)[:, 0])
    with pytest.raises(ValueError, match="length 0"):
        engine.register(torch.zeros(0))
    with pytest.raises(ValueError, match="needs a length"):
        engine.register(addr)
    snapshot = engine.registered()
    engine.unregister(addr)
    assert engine.registered() == {} and snapshot == {addr: 1024}
    with pytest.raises(TransferError, match="is not registered"):
        engine.unregister(addr)


@_live
def test_close_is_idempotent_and_unregisters():
    writer = Engine("127.0.0.1", protocol="tcp")
    reader = Engine("127.0.0.1", protocol="tcp")
    try:
        src = _random_bytes(256, seed=9)
        dst = torch.zeros(256, dtype=torch.uint8)
        writer.register(src)
        reader.register(dst)
        reader.register(torch.zeros(64, dtype=torch.uint8))
        writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [256])
        assert torch.equal(dst, src)
        reader.close()
        reader.close()
        assert reader.registered() == {}
        dst.zero_()
        with pytest.raises(TransferError, match=re.escape(reader.session_id)):
            writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [256])
        assert not dst.any()
        with pytest.raises(TransferError, match="is closed"):
            reader.register(torch.zeros(8, dtype=torch.uint8))
    finally:
        writer.close()
        reader.close()
    assert "closed" in repr(writer)


RDMA_DEVICES = rdma_device_names()


@pytest.mark.rdma
@pytest.mark.skipif(not RDMA_DEVICES, reason=f"no RDMA device under {engine_module.INFINIBAND_SYSFS}")
@_live
def test_rdma_write_lands_exact_bytes():
    with Engine("127.0.0.1", protocol="rdma") as writer, Engine("127.0.0.1", protocol="rdma") as reader:
        src = _random_bytes(1 << 20, seed=10)
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        writer.register(src)
        reader.register(dst)
        pieces = [(0, 4096, 65536), (100000, 0, 17), (200000, 300000, 0), (500000, 700000, 300000)]
        writer.write(reader.session_id, [src.data_ptr() + s for s, _, _ in pieces],
                     [dst.data_ptr() + d for _, d, _ in pieces], [n for _, _, n in pieces])
        expected = torch.zeros_like(dst)
        for s, d, n in pieces:
            expected[d:d + n] = src[s:s + n]
        assert torch.equal(dst, expected)


@_live
def test_device_memory_over_tcp_with_a_build_without_cuda_is_refused_before_mooncake_sees_it(pair):
    refusal = engine_module.device_memory_refusal(engine_module._installed_mooncake(), "tcp", "lazy:0")
    if refusal is None:
        pytest.skip("this host's Mooncake build moves device memory over tcp")
    writer, _ = pair
    rows = on_lazy_device(torch.ones(4, 16))  # a device that is not the CPU, which a CPU-only torch has
    before = writer.registered()
    with pytest.raises(EngineError, match=r"^cannot register memory on lazy:0 over tcp with .*, a Mooncake build "
                                          r"without CUDA: .* install the CUDA build"):
        writer.register(rows)
    assert writer.registered() == before
