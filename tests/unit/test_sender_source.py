"""What send() makes of its source: a raw pointer's geometry in the wire's spelling, served by an ask; which
tensors and pointers it refuses."""

from __future__ import annotations

import pytest
import torch

from transfer import _io
from transfer.core.encode import Conclude, EncodeCore, Offer, StartWrite
from transfer.frames import TransferInfo, dtype_size
from transfer.sender import _source

SRC, SPAN, HIDDEN = 0x7000_0000, 4, 256


@pytest.mark.parametrize("spelling", ["bfloat16", "torch.bfloat16", torch.bfloat16])
def test_a_raw_source_in_any_dtype_spelling_is_served_by_an_ask(spelling):
    region, span, hidden, dtype = _source(SRC, SPAN, HIDDEN, spelling)
    assert (region.addr, region.nbytes, dtype) == (SRC, SPAN * HIDDEN * 2, "torch.bfloat16")
    core = EncodeCore(now=0.0)
    core.offer(Offer(1, object(), region.addr, span, hidden, dtype, hidden * dtype_size(dtype)), 0.0)
    # What every prefill peer sends: str(torch.dtype).
    ask = TransferInfo(1, "10.0.0.7", 6000, "10.0.0.7:17000", 0x10000, 0, SPAN, HIDDEN, "torch.bfloat16", False, 1,
                       0, SPAN)
    actions = core.ask(ask, 0.1)
    assert [a for a in actions if isinstance(a, Conclude)] == []
    assert [(a.srcs, a.lengths) for a in actions if isinstance(a, StartWrite)] == [((SRC,), (SPAN * HIDDEN * 2,))]


def _never() -> bool:
    raise AssertionError("readability looked up")


def test_a_raw_source_inside_a_registered_tensor_takes_its_device_and_rows():
    from transfer.sender import raw_source_region

    owner = torch.arange(64, dtype=torch.uint8).view(4, 16)
    addr = owner.data_ptr() + 20
    region = raw_source_region(1, _source(addr, 1, 8, "torch.uint8")[0], owner, readable=_never, cuda=True,
                               integrity=True)
    assert (region.addr, region.nbytes, region.device) == (addr, 8, "cpu")
    assert region.tensor.tolist() == list(range(20, 28))


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("integrity", [True, False])
def test_a_raw_source_of_readable_memory_is_taken_for_host_memory(cuda, integrity):
    from transfer.sender import raw_source_region

    region = _source(SRC, SPAN, HIDDEN, "bfloat16")[0]
    assert raw_source_region(1, region, None, readable=lambda: True, cuda=cuda, integrity=integrity) is region


def test_an_unreadable_raw_source_may_be_gpu_memory_only_where_cuda_is_and_no_checksum_reads_it():
    from transfer.sender import raw_source_region

    region = _source(SRC, SPAN, HIDDEN, "bfloat16")[0]
    assert raw_source_region(1, region, None, readable=_never, cuda=True, integrity=False) is region


def test_an_unreadable_raw_source_is_refused_where_cuda_memory_may_be_and_its_checksum_is_read():
    from transfer.errors import ConfigError
    from transfer.sender import raw_source_region

    region = _source(SRC, SPAN, HIDDEN, "bfloat16")[0]
    with pytest.raises(ConfigError, match=r"^room 1: raw source pointer 0x70000000 \(2048 bytes\) is not host memory "
                                          r"this process can read, so its checksums cannot be read: pass the tensor, "
                                          r"register the tensor that holds it, or use integrity=False$"):
        raw_source_region(1, region, None, readable=lambda: False, cuda=True, integrity=True)


@pytest.mark.parametrize("integrity", [True, False])
def test_an_unreadable_raw_source_is_refused_on_a_host_without_cuda(integrity):
    """Its checksum, or Mooncake's copy over tcp, would read it and kill the process."""
    from transfer.errors import ConfigError
    from transfer.sender import raw_source_region

    region = _source(0x10, SPAN, HIDDEN, "bfloat16")[0]
    with pytest.raises(ConfigError, match=r"^room 1: raw source pointer 0x10 \(2048 bytes\) is not memory this "
                                          r"process can read \(this host has no CUDA device\)"):
        raw_source_region(1, region, None, readable=lambda: False, cuda=False, integrity=integrity)


def test_host_memory_reads_readable_and_an_inaccessible_mapping_does_not():
    import ctypes
    import mmap

    from transfer import _io

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    base = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    try:
        assert _io.host_readable(base, 2 * page)
        # How GPU memory in CUDA's unified address space looks from the host: mapped, not readable.
        assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
        assert _io.host_readable(base, page)
        assert not _io.host_readable(base + page - 8, 16)
        assert not _io.host_readable(base + page, 8)
    finally:
        libc.munmap(base, 2 * page)
    assert not _io.host_readable(8, 8)  # nothing is mapped at page 0


def test_a_source_tensor_of_a_dtype_the_wire_has_no_name_for_is_a_config_error():
    from transfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^unknown dtype torch.complex64"):
        _source(torch.zeros(2, 4, dtype=torch.complex64), None, None, None)


def test_a_lazily_negated_source_is_refused():
    from transfer.errors import ConfigError

    source = torch.full((1, 1), 3.5 + 3.5j, dtype=torch.complex64).conj().imag  # reads -3.5, holds 3.5
    assert source.is_neg() and source.is_contiguous()
    with pytest.raises(ConfigError, match="lazily negated or conjugated view"):
        _source(source, None, None, None)


@pytest.mark.parametrize("cuda, integrity, readable, problem", [
    (False, True, True, None), (False, False, True, None), (True, True, True, None), (True, False, True, None),
    (True, False, False, None),
    (True, True, False, "is not host memory this process can read, so its checksums cannot be read"),
    (False, True, False, "is not memory this process can read (this host has no CUDA device)"),
    (False, False, False, "is not memory this process can read (this host has no CUDA device)"),
])
def test_memory_given_by_address_must_be_readable_unless_it_may_be_gpu_memory_no_checksum_reads(
        cuda, integrity, readable, problem):
    from transfer import _io

    assert _io.raw_memory_problem(lambda: readable, cuda=cuda, integrity=integrity) == problem


def test_a_source_that_is_not_contiguous_is_refused_with_what_to_pass_instead():
    from transfer.errors import ConfigError

    items = torch.zeros(8, 4, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"^source of shape \(4, 8\) and strides \(1, 4\) is not contiguous: .*; "
                                          r"pass src\.contiguous\(\)$"):
        _source(items.t(), None, None, None)
    with pytest.raises(ConfigError, match=r"^deepstack of shape \(8, 2\) .* pass deepstack\.contiguous\(\)$"):
        _source(items[:, :2], None, None, None, name="deepstack")


def test_a_deepstack_tensor_that_disagrees_with_its_item_is_refused_naming_deepstack():
    # What send() passes for a deepstack tensor: no sizes of its own but deepstack_hidden.
    from transfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^deepstack_hidden 256 disagrees with the deepstack tensor's 512$"):
        _source(torch.zeros(4, 512), None, 256, None, name="deepstack")
    with pytest.raises(ConfigError, match=r"^deepstack must be 2-D \[span, deepstack_hidden\], got shape \(512,\)$"):
        _source(torch.zeros(512), None, None, None, name="deepstack")
    with pytest.raises(ConfigError, match=r"^a raw deepstack pointer needs deepstack_hidden$"):
        _source(SRC, SPAN, None, "bfloat16", name="deepstack")
    with pytest.raises(ConfigError, match=r"^a raw deepstack's deepstack_hidden must be a positive integer, got 0$"):
        _source(SRC, SPAN, 0, "bfloat16", name="deepstack")


@pytest.mark.parametrize("make, message", [
    (lambda: torch.zeros(4, 8).to_sparse(), r"^source is a torch\.sparse_coo tensor, .*: pass src\.to_dense\(\)$"),
    (lambda: torch.zeros(4, 8).to_sparse_csr(), r"^source is a torch\.sparse_csr tensor, .*: pass src\.to_dense\(\)$"),
    (lambda: torch.empty(4, 8, device="meta"), r"^source is on device meta, which holds no memory: pass a tensor on "),
])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_a_source_tensor_without_rows_in_memory_is_refused_with_what_to_pass_instead(make, message):
    from transfer.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _source(make(), None, None, None)


def test_a_raw_source_given_by_numpy_or_torch_integer_scalars_is_taken_as_plain_ints():
    # A pointer or size computed with numpy (base + offsets[i]) is an integer scalar, not an int.
    import numpy as np

    region, span, hidden, dtype = _source(np.uint64(SRC), np.int64(SPAN), torch.tensor(HIDDEN), "bfloat16")
    assert (region.addr, region.nbytes, span, hidden, dtype) == (SRC, SPAN * HIDDEN * 2, SPAN, HIDDEN,
                                                                  "torch.bfloat16")
    assert all(type(value) is int for value in (region.addr, region.nbytes, span, hidden))
    _, span, hidden, _ = _source(torch.zeros(SPAN, HIDDEN), np.int64(SPAN), np.int32(HIDDEN), None)
    assert (span, hidden) == (SPAN, HIDDEN)


@pytest.mark.parametrize("span", [True, 2.0, torch.tensor(True), torch.tensor([4])])
def test_a_raw_sources_span_that_is_no_integer_is_still_refused(span):
    from transfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^a raw source's span must be a non-negative integer"):
        _source(SRC, span, HIDDEN, "bfloat16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int64])
@pytest.mark.parametrize("make", [
    lambda dtype: torch.zeros(5, 24, dtype=dtype),
    lambda dtype: torch.zeros(9, 24, dtype=dtype)[3:7],  # rows of a larger tensor: a storage offset
    lambda dtype: torch.zeros(1, 1, dtype=dtype),
    lambda dtype: torch.zeros(0, 8, dtype=dtype),
    lambda dtype: torch.zeros(2, 3, 8, dtype=dtype)[1],  # a 2-D view of a 3-D tensor
], ids=["whole", "rows", "one", "empty", "slab"])
def test_a_source_tensors_region_is_the_one_as_region_makes_of_it(dtype, make):
    tensor = make(dtype)
    region, span, hidden, name = _source(tensor, None, None, None)
    expected = _io.as_region(tensor)
    assert (region.addr, region.nbytes, region.device) == (expected.addr, expected.nbytes, expected.device)
    assert region.tensor is tensor
    assert (span, hidden, name) == (tensor.shape[0], tensor.shape[1], str(dtype))
