"""Where the checksum of a region's rows is read: host memory by address, memory on any other device through
its tensor, on that device (an address there is no host address)."""

from __future__ import annotations

import torch
from fakes import on_lazy_device

from transfer import _io, wire


def test_the_checksum_of_rows_on_a_device_other_than_cpu_and_cuda_is_read_on_that_device():
    rows = torch.arange(4 * 8, dtype=torch.int16).view(4, 8)
    on_device = on_lazy_device(rows)
    region = _io.as_region(on_device)
    assert region.device == "lazy:0"
    row = 8 * 2
    assert _io.checksum(region, region.addr, region.nbytes) == wire.tensor_layer_sum(rows)
    # The second and third rows, as a write of a shard of them reads them.
    assert _io.checksum(region, region.addr + row, 2 * row) == wire.tensor_layer_sum(rows[1:3])


def test_the_checksum_of_host_rows_is_read_by_address():
    rows = torch.arange(4 * 8, dtype=torch.int16).view(4, 8)
    region = _io.as_region(rows[1:])
    assert _io.checksum(region, region.addr, region.nbytes) == wire.tensor_layer_sum(rows[1:])
    assert _io.checksum(_io.Region(region.addr, region.nbytes), region.addr + 16, 16) == wire.tensor_layer_sum(rows[2])
