"""Which device memory an Engine refuses to register, by its Mooncake build and protocol
(transfer.engine.device_memory_refusal)."""

from __future__ import annotations

import pytest

from transfer.engine import device_memory_refusal

HOST_ONLY = {"mooncake-transfer-engine-non-cuda": "0.3.13.post1"}


def test_device_memory_over_tcp_with_a_build_without_cuda_is_refused_naming_the_fix():
    problem = device_memory_refusal(HOST_ONLY, "tcp", "cuda:0")
    assert problem == ("cannot register memory on cuda:0 over tcp with mooncake-transfer-engine-non-cuda "
                       "0.3.13.post1, a Mooncake build without CUDA: its copies would read and write the device "
                       "address as host memory and kill the process; install the CUDA build (pip uninstall "
                       "mooncake-transfer-engine-non-cuda && pip install mooncake-transfer-engine), or register "
                       "host memory")


@pytest.mark.parametrize("installed, protocol", [
    ({"mooncake-transfer-engine": "0.3.13.post1"}, "tcp"),  # the CUDA build copies device memory itself
    (HOST_ONLY, "rdma"),  # the NIC reads it (GPUDirect), not Mooncake's copies
    ({}, "tcp"),  # no wheel to judge by: the engine would not start anyway
    ({**HOST_ONLY, "mooncake-transfer-engine": "0.3.13.post1"}, "tcp"),  # which one loads is the doctor's warning
])
def test_anything_else_is_left_to_mooncake(installed, protocol):
    assert device_memory_refusal(installed, protocol, "cuda:0") is None
