"""transfer.buffers against real Mooncake engines (protocol tcp on 127.0.0.1) and CUDA events."""

from __future__ import annotations

import pytest
import torch
from fakes import FakeClock, RecordingEngine

from transfer.buffers import ReceivePool


try:
    import mooncake.engine  # noqa: F401
    _MOONCAKE_MISSING = ""
except ImportError as _error:
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

SLOT = 256
GRACE = 10.0


@pytest.mark.parametrize("protocol", ["tcp"])
@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_real_engine_registers_once_and_a_write_lands_in_the_slot(protocol):
    from transfer.engine import Engine

    clock = FakeClock()
    with Engine("127.0.0.1", protocol=protocol) as writer, Engine("127.0.0.1", protocol=protocol) as reader:
        pool = ReceivePool(reader, 8 * SLOT, SLOT, clock=clock, grace_s=GRACE)
        assert reader.registered() == {pool.region.addr: 8 * SLOT}
        slots = [pool.lease(SLOT) for _ in range(8)]
        for slot in slots[:5]:
            slot.release()
        for _ in range(3):
            pool.lease(SLOT).release()
        assert reader.registered() == {pool.region.addr: 8 * SLOT}  # leases never re-register

        target = pool.lease(100)
        source = torch.randint(0, 256, (100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        writer.register(source)
        writer.write(reader.session_id, [source.data_ptr()], [target.addr], [100])
        assert torch.equal(target.view((100,), torch.uint8), source)

        big = pool.lease_or_fallback(SLOT * 3)
        assert big.is_fallback and reader.registered()[big.addr] == SLOT * 3
        writer.write(reader.session_id, [source.data_ptr()], [big.addr + 5], [100])
        assert torch.equal(big.view((SLOT * 3,), torch.uint8)[5:105], source)
        big.release()
        pool.poll()
        assert big.addr in reader.registered()
        clock.advance(GRACE)
        pool.poll()
        assert reader.registered() == {pool.region.addr: 8 * SLOT}

        pool.close()
        assert reader.registered() == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_frees_a_slot_after_the_copy_out_event():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, 4 * SLOT, SLOT, device="cuda:0", clock=clock) as pool:
        assert pool.region.device == "cuda:0" and pool.region.tensor.is_cuda
        slot = pool.lease(SLOT)
        rows = slot.view((SLOT // 4,), torch.float32)
        rows.copy_(torch.arange(SLOT // 4, dtype=torch.float32, device="cuda:0"))
        host = torch.empty(SLOT // 4, dtype=torch.float32, pin_memory=True)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        slot.release(event)
        event.synchronize()
        pool.poll()
        assert pool.stats()["free"] == 4
        assert torch.equal(host, torch.arange(SLOT // 4, dtype=torch.float32))


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "torch.bfloat16"])
def test_a_pooled_receive_takes_every_spelling_of_its_dtype(dtype):
    from transfer.engine import Engine
    from transfer.receiver import SessionManager

    with Engine("127.0.0.1", protocol="tcp") as engine, ReceivePool(engine, 4 * 4096, 4096) as pool, \
            SessionManager(engine, 0, 1, 1, pool=pool, deadline_s=5.0) as manager:
        # Nothing serves 127.0.0.1:9 (discard): the room fails later; its slot's geometry is what counts.
        handle = manager.receive(1, "127.0.0.1:9", rows=8, hidden=64, dtype=dtype)
        assert handle.rows.dtype is torch.bfloat16 and tuple(handle.rows.shape) == (8, 64)
        handle.clear()
