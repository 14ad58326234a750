"""One exception base for the library, kinds that are also the built-in a caller caught before, and
dtypes accepted in every spelling (a torch.dtype, "torch.NAME", "NAME")."""

from __future__ import annotations

import pytest
import torch

import transfer
from transfer import _io, errors, frames, wire
from transfer.bootstrap import BootstrapClient
from transfer.engine import effective_protocol, usable_rdma_devices

KINDS = [
    (errors.ConfigError, ValueError),
    (errors.ConfigTypeError, TypeError),
    (errors.WireError, ValueError),
    (errors.EngineError, RuntimeError),
    (errors.EngineUnavailable, RuntimeError),
    (errors.BootstrapError, RuntimeError),
    (errors.BootstrapUnreachable, RuntimeError),
    (errors.BootstrapNoRoute, RuntimeError),
    (errors.SlotError, RuntimeError),
    (errors.CollectiveError, errors.UsageError),
    (errors.FallbackLimitError, RuntimeError),
    (wire.FrameError, OSError),
    (wire.MsgError, ValueError),
    (wire.LayerError, ValueError),
]


@pytest.mark.parametrize("kind, builtin", KINDS, ids=lambda k: getattr(k, "__name__", ""))
def test_every_kind_is_a_transfer_error_and_its_builtin(kind, builtin):
    assert issubclass(kind, transfer.TransferError) and issubclass(kind, builtin)


def test_the_package_exports_every_kind_and_the_modules_use_the_same_classes():
    for name in errors.__all__:
        assert getattr(transfer, name) is getattr(errors, name)
    from transfer import bootstrap, buffers, engine, wire_engine

    assert frames.WireError is errors.WireError and issubclass(frames.UnreadableChecksum, errors.WireError)
    assert bootstrap.BootstrapError is errors.BootstrapError
    assert buffers.FallbackLimitError is errors.FallbackLimitError and buffers.SlotError is errors.SlotError
    assert engine.EngineUnavailable is errors.EngineUnavailable
    # The engines' old name for their error stays importable.
    assert engine.TransferError is errors.EngineError and wire_engine.TransferError is errors.EngineError


def test_a_native_error_keeps_its_errno_and_is_caught_by_the_base():
    error = wire.FrameError(32, "write: Broken pipe")
    assert error.errno == 32
    with pytest.raises(transfer.TransferError, match="not UTF-8"):
        wire.Msg.decode(b"\xff\xfe")


@pytest.mark.parametrize("call, kind", [
    (lambda: frames.shard_rows(4, 2, 2), errors.ConfigError),
    (lambda: frames.check_room(-1), errors.ConfigError),
    (lambda: frames.check_parallel(3, 2, 1), errors.ConfigError),
    (lambda: frames.parse_status([b"x", b"5", b"0"]), errors.WireError),
    (lambda: BootstrapClient("no-port-here"), errors.ConfigError),
    (lambda: BootstrapClient("http://encode-node:8998"), errors.ConfigError),
    (lambda: frames.check_room("5"), errors.ConfigTypeError),
    (lambda: frames.check_room(True), errors.ConfigTypeError),
    (lambda: frames.check_room(5.0), errors.ConfigTypeError),
    (lambda: wire.Msg().set("k", 1.5), errors.ConfigTypeError),
])
def test_caller_and_wire_mistakes_raise_their_kind(call, kind):
    with pytest.raises(kind):
        call()


def test_a_room_of_the_wrong_type_says_so_and_an_int_like_room_passes():
    import numpy as np

    with pytest.raises(errors.ConfigTypeError, match=r"room must be an int, got str '5'"):
        frames.check_room("5")
    frames.check_room(np.int64(5))
    frames.check_room(0)


def test_a_bootstrap_url_is_refused_naming_the_form_wanted():
    with pytest.raises(errors.ConfigError, match=r"host:port without a scheme, got 'http://encode-node:8998'"):
        BootstrapClient("http://encode-node:8998")


@pytest.mark.parametrize("spelling", [torch.bfloat16, "bfloat16", "torch.bfloat16"], ids=str)
def test_every_spelling_of_a_dtype_names_the_same_wire_dtype(spelling):
    assert frames.normalize_dtype(spelling) == "torch.bfloat16"
    assert frames.dtype_size(spelling) == 2


#: The dtypes the wire carries, as SPEC.md's dtype part spells them (`str(torch.dtype)`; it names
#: torch.bfloat16), with their element sizes: written out here, not read from DTYPE_BYTES.
WIRE_DTYPES = {
    "torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.float64": 8,
    "torch.int8": 1, "torch.uint8": 1, "torch.int16": 2, "torch.int32": 4, "torch.int64": 8,
    "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1, "torch.bool": 1,
}


def test_every_torch_dtype_the_wire_knows_normalizes_to_its_own_name():
    assert frames.DTYPE_BYTES == WIRE_DTYPES
    for name, size in WIRE_DTYPES.items():
        dtype = getattr(torch, name.removeprefix("torch."))
        assert frames.normalize_dtype(dtype) == name and frames.dtype_size(dtype) == size
        assert frames.normalize_dtype(name) == name and frames.dtype_size(name) == size


@pytest.mark.parametrize("bad", [torch.complex64, "complex64", "torch.nope", "", None, 2])
def test_an_unknown_dtype_is_a_config_error_naming_the_choices(bad):
    with pytest.raises(errors.ConfigError, match=r"unknown dtype .*bfloat16"):
        frames.normalize_dtype(bad)
    with pytest.raises(errors.WireError, match="unknown dtype"):
        frames.dtype_size(bad)


def test_a_torch_dtype_the_wire_has_no_name_for_is_not_told_to_be_a_torch_dtype():
    with pytest.raises(errors.ConfigError) as caught:
        frames.normalize_dtype(torch.complex64)
    assert str(caught.value).startswith("unknown dtype torch.complex64: the wire carries only bfloat16, float16, ")
    assert str(caught.value).endswith(", bool (a torch.dtype, or its name with or without 'torch.')")


def _device(root, name: str, *states: str) -> None:
    for port, state in enumerate(states, 1):
        folder = root / name / "ports" / str(port)
        folder.mkdir(parents=True)
        (folder / "state").write_text(state + "\n")


def test_only_a_device_with_an_active_port_is_usable(tmp_path):
    _device(tmp_path, "mlx5_0", "1: DOWN")
    _device(tmp_path, "mlx5_1", "1: DOWN", "4: ACTIVE")
    (tmp_path / "rxe9").mkdir()  # listed, no ports
    assert usable_rdma_devices(str(tmp_path)) == ["mlx5_1"]


def test_rdma_asked_for_without_a_usable_device_fails_saying_what_to_do(tmp_path):
    _device(tmp_path, "mlx5_0", "1: DOWN")
    with pytest.raises(errors.EngineError, match=r"protocol 'rdma' needs a usable RDMA device, and mlx5_0 has no "
                                                 r"ACTIVE port: use protocol 'tcp'.*soft-roce.sh up"):
        effective_protocol("rdma", root=str(tmp_path))
    with pytest.raises(errors.EngineError, match="no RDMA device under"):
        effective_protocol("rdma", root=str(tmp_path / "absent"))


def test_auto_runs_tcp_when_no_device_is_usable_and_says_why(tmp_path):
    _device(tmp_path, "mlx5_0", "1: DOWN")
    assert effective_protocol("auto", root=str(tmp_path)) == ("tcp", "RDMA device(s) mlx5_0 has no ACTIVE port")
    _device(tmp_path, "mlx5_1", "4: ACTIVE")
    protocol, why = effective_protocol("auto", root=str(tmp_path))
    assert protocol == "rdma" and why.endswith("usable: mlx5_1")


def test_a_named_device_must_exist_and_be_usable(tmp_path):
    _device(tmp_path, "mlx5_0", "1: DOWN")
    _device(tmp_path, "mlx5_1", "4: ACTIVE")
    assert effective_protocol("rdma", "mlx5_1", root=str(tmp_path))[0] == "rdma"
    with pytest.raises(errors.EngineError, match="mlx5_0 has no ACTIVE port"):
        effective_protocol("rdma", "mlx5_0", root=str(tmp_path))
    with pytest.raises(errors.ConfigError, match=r"RDMA device mlx5_7 not under .*found: mlx5_0, mlx5_1"):
        effective_protocol("rdma", "mlx5_7", root=str(tmp_path))
    assert effective_protocol("tcp", "mlx5_7", root=str(tmp_path)) == ("tcp", "requested")


def test_the_library_raises_its_own_kinds_and_no_bare_built_in():
    import glob
    import os
    import re

    root = os.path.dirname(transfer.__file__)
    tools = {"bench.py", "cli.py", "doctor.py", "harness.py"}  # the CLI's commands, not the library's API
    bare = re.compile(r"raise (ValueError|TypeError|RuntimeError|OSError|KeyError)\(")
    found = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        if os.path.basename(path) in tools:
            continue
        with open(path, encoding="utf-8") as fh:
            found += [f"{os.path.relpath(path, root)}:{n}" for n, line in enumerate(fh, 1) if bare.search(line)]
    assert found == []


@pytest.mark.parametrize("call, kind", [
    (lambda: _io.as_region(object()), errors.ConfigTypeError),
    (lambda: _io.as_region(0x1000), errors.ConfigError),
])
def test_a_misused_call_raises_a_transfer_error_that_is_also_the_built_in(call, kind):
    with pytest.raises(transfer.TransferError) as err:
        call()
    assert type(err.value) is kind
