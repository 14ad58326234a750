"""The README's two integration blocks, run as written: one encode rank and two prefill ranks in
their own processes over Mooncake tcp on loopback, with a ReceivePool and reassembly over gloo.
Only the settings lines are replaced (addresses, sizes, device: the host's memory, and a CUDA
device's where there is one); every rebuilt row is checked, and each handle's `stages` are the ones
the README's "Where a room's time goes" names, in its order."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import re
import socket
import time
import traceback

import pytest
import torch
from live_helpers import cuda_mooncake_missing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.live

try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

#: Rooms and their spans: uneven, one smaller than the two prefill ranks' group (an empty shard).
ROOMS = {0: 37, 1: 64, 2: 1, 3: 100}
HIDDEN = 64
WAIT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _block(heading: str) -> str:
    """The first Python block after the README heading `heading`."""
    with open(os.path.join(REPO, "README.md")) as fh:
        readme = fh.read()
    start = readme.index(f"### {heading}")
    return re.search(r"```python\n(.*?)```", readme[start:], re.S).group(1)


def _with_settings(code: str, settings: dict[str, str]) -> str:
    """The block with each `NAME = ...` settings line replaced; each must occur exactly once."""
    for names, value in settings.items():
        pattern = re.compile(rf"^{re.escape(names)} = .*$", re.M)
        assert len(pattern.findall(code)) == 1, f"the README block has no single `{names} = ...` line"
        code = pattern.sub(lambda _: f"{names} = {value}", code)
    return code


def _stages(side: str) -> list[str]:
    """The stages the README's "Where a room's time goes" names for `side` ("prefill" or "encode"), in order."""
    with open(os.path.join(REPO, "README.md")) as fh:
        text = " ".join(fh.read().partition("### Where a room's time goes")[2].partition("\n## ")[0].split())
    said = re.split(rf"[Oo]n the {side} side, ", text, maxsplit=1)[1]
    said = re.sub(r"\([^()]*(?:\([^()]*\)[^()]*)*\)", "", said)  # drop each stage's explanation
    return re.findall(r"`(\w+)`", said.partition(";")[0].partition(". ")[0])


def _item(room: int, span: int):
    """The rows the encode rank offers for `room`, rebuilt the same way on the prefill side."""

    gen = torch.Generator().manual_seed(1000 + room)
    return torch.randn(span, HIDDEN, generator=gen).to(torch.bfloat16)


def _encode(code: str, done, results) -> None:
    """Runs the README's encode block, offers every room, reaps them all."""
    try:
        scope: dict = {"__name__": "readme_encode"}
        exec(compile(code, "README.md (encode side)", "exec"), scope)
        out = scope["out"]
        handles = {}
        for slot, (room, span) in enumerate(ROOMS.items()):
            out[slot, :span] = _item(room, span)
            handles[room] = scope["offer"](room, slot, span)
        offered = dict(handles)
        finished: list[int] = []
        deadline = time.monotonic() + WAIT_S
        while len(finished) < len(ROOMS) and time.monotonic() < deadline:
            failed = {room: handles[room].failure for room in handles if handles[room].failure}
            finished += scope["reap"](handles)
            if failed:
                results.put(("encode", f"rooms failed: {failed}"))
                return
            time.sleep(0.01)
        stages = {tuple(handle.stages) for handle in offered.values()}
        if stages != {tuple(_stages("encode"))}:
            results.put(("encode", f"send handles' stages {stages}, the README says {_stages('encode')}"))
            return
        results.put(("encode", sorted(finished)))
        done.wait(WAIT_S)  # the bootstrap server lives here: keep it up until the prefill ranks are through
        scope["pool"].close()
        if scope["server"] is not None:
            scope["server"].close()
        scope["engine"].close()
    except BaseException:  # noqa: BLE001 - the test process reports it
        results.put(("encode", traceback.format_exc()))


def _prefill(code: str, rank: int, init_port: int, results) -> None:
    """Joins a gloo group of two, runs the README's prefill block, asks, rebuilds and checks every row."""
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=2)
        scope: dict = {"__name__": "readme_prefill"}
        # The block itself waits for the encode rank (BootstrapClient.wait_ready): started together.
        exec(compile(code, "README.md (prefill side)", "exec"), scope)
        handles = [scope["ask"](room, span) for room, span in ROOMS.items()]
        deadline = time.monotonic() + WAIT_S
        while not all(scope["concluded"](h) for h in handles):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rooms still open: {[h.room for h in handles if not scope['concluded'](h)]}")
            time.sleep(0.01)
        failures = {h.room: h.failure for h in handles if h.failure}
        stages = {tuple(h.stages) for h in handles}
        assert stages == {tuple(_stages("prefill"))}, (stages, _stages("prefill"))
        rebuilt = scope["rebuild"](handles)
        checked = 0
        for (room, span), rows in zip(ROOMS.items(), rebuilt):
            assert rows is not None, f"room {room} failed: {failures}"
            assert torch.equal(rows.cpu().view(torch.int16), _item(room, span).view(torch.int16)), f"room {room} differs"
            checked += rows.numel() * rows.element_size()
        for handle in handles:
            handle.clear()
        scope["manager"].close()
        scope["pool"].close()
        scope["engine"].close()
        dist.destroy_process_group()
        results.put((f"prefill-{rank}", checked))
    except BaseException:  # noqa: BLE001 - the test process reports it
        results.put((f"prefill-{rank}", traceback.format_exc()))


def test_the_readme_names_each_sides_stages():
    assert _stages("prefill") == ["asked", "status", "concluded"]
    assert _stages("encode") == ["asked", "writing", "submitted", "concluded"]


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(bool(cuda_mooncake_missing()), reason=cuda_mooncake_missing() or "-")])])
def test_the_readme_integration_moves_and_rebuilds_every_row(device):
    port = _free_port()
    encode_code = _with_settings(_block("Encode side"), {
        "HOST": '"127.0.0.1"', "BOOTSTRAP_PORT": str(port), "E": "1",
        "HIDDEN, MAX_ROWS, SLOTS": f"{HIDDEN}, 128, {len(ROOMS)}", "DEVICE": repr(device), "e": "0",
    })
    prefill_code = _with_settings(_block("Prefill side"), {
        "BOOTSTRAP": f'"127.0.0.1:{port}"', "HOST": '"127.0.0.1"', "P, E": "2, 1",
        "HIDDEN, DTYPE": f'{HIDDEN}, "torch.bfloat16"', "DEVICE": repr(device), "POOL_BYTES, SLOT_BYTES": "1 << 20, 64 << 10",
    })
    ctx = mp.get_context("spawn")
    done, results = ctx.Event(), ctx.Queue()
    init_port = _free_port()
    procs = [ctx.Process(target=_encode, args=(encode_code, done, results), name="encode")]
    procs += [ctx.Process(target=_prefill, args=(prefill_code, r, init_port, results), name=f"prefill-{r}")
              for r in range(2)]
    for proc in procs:
        proc.start()
    outcome: dict = {}
    try:
        deadline = time.monotonic() + 3 * WAIT_S
        while len(outcome) < 3 and time.monotonic() < deadline:
            try:
                name, value = results.get(timeout=1)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            outcome[name] = value
            if name.startswith("prefill") and sum(k.startswith("prefill") for k in outcome) == 2:
                done.set()
    finally:
        done.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert outcome.get("encode") == sorted(ROOMS), outcome
    total = sum(ROOMS.values()) * HIDDEN * 2
    assert outcome.get("prefill-0") == total and outcome.get("prefill-1") == total, outcome


def _rebuild_code() -> str:
    """The README prefill block's imports and its `rebuild` function, nothing that needs an engine."""
    import ast

    tree = ast.parse(_block("Prefill side"))
    kept = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            or (isinstance(node, ast.FunctionDef) and node.name == "rebuild")]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


class _Handle:
    """What `rebuild` reads of a pooled receive's handle with deepstack rows: this rank's shard filled."""

    def __init__(self, room: int, span: int, rank: int) -> None:

        from transfer.frames import shard_rows
        from transfer.status import TransferPoll

        self.room, self.shard = room, shard_rows(span, rank, 2)
        start, count = self.shard
        self.rows = torch.zeros(span, HIDDEN, dtype=torch.bfloat16)
        self.deepstack = torch.zeros(span, 3 * HIDDEN, dtype=torch.bfloat16)
        self.rows[start : start + count] = _item(room, span)[start : start + count]
        self.deepstack[start : start + count] = _deepstack(room, span)[start : start + count]
        self._poll = TransferPoll.Success

    def poll(self):
        return self._poll


def _deepstack(room: int, span: int):
    """The deepstack rows (3 layers) the encode rank offers for `room`."""

    gen = torch.Generator().manual_seed(2000 + room)
    return torch.randn(span, 3 * HIDDEN, generator=gen).to(torch.bfloat16)


def _rebuild_rank(code: str, rank: int, init_port: int, results) -> None:
    """Runs the README's `rebuild` on handles holding this rank's shard of embedding and deepstack rows."""
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=2)
        scope: dict = {"__name__": "readme_rebuild"}
        exec(compile(code, "README.md (prefill side, rebuild)", "exec"), scope)
        handles = [_Handle(room, span, rank) for room, span in ROOMS.items()]
        rebuilt = scope["rebuild"](handles)
        outcome = {}
        for handle, rows in zip(handles, rebuilt):
            span = ROOMS[handle.room]
            outcome[handle.room] = (rows is not None and torch.equal(rows.view(torch.int16),
                                                                     _item(handle.room, span).view(torch.int16)),
                                    torch.equal(handle.deepstack.view(torch.int16),
                                                _deepstack(handle.room, span).view(torch.int16)))
        dist.destroy_process_group()
        results.put((rank, outcome))
    except BaseException:  # noqa: BLE001 - the test process reports it
        results.put((rank, traceback.format_exc()))


def test_the_readme_rebuild_rebuilds_the_deepstack_rows_too():
    # The README asks for deepstack rows with receive(..., deepstack_hidden=): its rebuild must
    # gather the other ranks' deepstack rows as well, or they stay what the slot held before.
    code = _rebuild_code()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_port = _free_port()
    procs = [ctx.Process(target=_rebuild_rank, args=(code, r, init_port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        outcome = dict(results.get(timeout=WAIT_S) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    for rank in range(2):
        assert outcome[rank] == {room: (True, True) for room in ROOMS}, (rank, outcome[rank])
