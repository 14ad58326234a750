"""What send() makes of its source: a raw pointer's geometry in the wire's spelling, served by an ask."""

from __future__ import annotations

import pytest
import torch

from transfer.core.encode import Conclude, EncodeCore, Offer, StartWrite
from transfer.frames import TransferInfo, dtype_size
from transfer.sender import _source

SRC, SPAN, HIDDEN = 0x7000_0000, 4, 256


@pytest.mark.parametrize("spelling", ["bfloat16", "torch.bfloat16", torch.bfloat16])
def test_a_raw_source_in_any_dtype_spelling_is_served_by_an_ask(spelling):
    region, span, hidden, dtype = _source(SRC, SPAN, HIDDEN, spelling)
    assert (region.addr, region.nbytes, dtype) == (SRC, SPAN * HIDDEN * 2, "torch.bfloat16")
    core = EncodeCore(0, now=0.0)
    core.offer(Offer(1, object(), region.addr, span, hidden, dtype, hidden * dtype_size(dtype)), 0.0)
    # What every prefill peer sends: str(torch.dtype).
    ask = TransferInfo(1, "10.0.0.7", 6000, "10.0.0.7:17000", 0x10000, 0, SPAN, HIDDEN, "torch.bfloat16", False, 1,
                       0, SPAN)
    actions = core.ask(ask, 0.1)
    assert [a for a in actions if isinstance(a, Conclude)] == []
    assert [(a.srcs, a.lengths) for a in actions if isinstance(a, StartWrite)] == [((SRC,), (SPAN * HIDDEN * 2,))]
