"""A rank process that cannot allocate its buffers ends the run with one line naming the buffer, its size and
what to do, not its traceback (transfer.harness.run, transfer.bench.RankSet). Here their sizes pass no
check before the ranks start: the library calls make none; the command line refuses such sizes up front."""

from __future__ import annotations

import re

import pytest

from transfer import bench, harness

#: More bytes than any host's address space holds: an allocation of it fails at once.
EXABYTE = 2**60


@pytest.mark.live
def test_a_demo_rank_whose_items_cannot_be_allocated_ends_the_run_in_one_line():
    # Items of 2**29 rows of 2**28 bfloat16 elements: their pool of 2 x 2**29 rows is 2**59 bytes.
    sc = harness.Scenario(encode_ranks=1, prefill_ranks=1, items=1, span=2**29, hidden=2**28, protocol="wire",
                          timeout_s=60)
    with pytest.raises(RuntimeError) as caught:
        harness.run(sc)
    message = str(caught.value)
    assert re.fullmatch(r"(encode|prefill) rank 0: cannot allocate an item pool of 1073741824 x 268435456 "
                        r"torch\.bfloat16, 536,870,912\.0 GiB \(576460752303423488 bytes\): give a smaller "
                        r"--span, --hidden, --inflight or --deepstack, or run fewer ranks on this host", message), message


@pytest.mark.live
def test_a_bench_rank_whose_arena_cannot_be_allocated_ends_the_bench_in_one_line():
    opts = bench.Options(sizes=[(64, 256)], fanouts=[1], inflight=[1], paths=["wire"], integrity=[False], items=1,
                         timeout_s=60.0)
    with pytest.raises(RuntimeError) as caught:
        with bench.RankSet(opts, 1, [EXABYTE]):
            pass
    assert str(caught.value) == ("prefill rank 0: cannot allocate its receive arena, 1,073,741,824.0 GiB "
                                 "(1152921504606846976 bytes): give smaller --sizes, or a lower --inflight, --fanouts "
                                 "or --encode-ranks")
