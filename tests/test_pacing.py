"""The pacer: deferred work runs in order, in slices, with the loop's own
callbacks (a control request read meanwhile) between the slices."""

from __future__ import annotations

import asyncio
import socket
import time

import msgspec
import pytest

from ipc import messages as m
from ipc.connection import FramedProtocol
from ipc.framing import encode_frame
from ipc.pacing import Pacer

pytestmark = pytest.mark.protocol


def test_runs_in_order_in_slices_with_the_loop_between() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        pacer = Pacer(budget_secs=0.002)
        seen: list[str] = []

        def work(i: int) -> None:
            seen.append(f"w{i}")
            time.sleep(0.001)  # two items fill a slice

        for i in range(6):
            pacer.defer(work, i)
        # Scheduled after the first slice: runs before the pacer finishes.
        loop.call_soon(lambda: loop.call_soon(seen.append, "control"))
        while len(pacer):
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        return seen

    seen = asyncio.run(main())
    assert [s for s in seen if s != "control"] == [f"w{i}" for i in range(6)]
    where = seen.index("control")
    assert 0 < where < 6, seen


def test_a_failing_item_does_not_stall_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[int]:
        pacer = Pacer()
        seen: list[int] = []

        def boom() -> None:
            raise RuntimeError("bug in one item")

        pacer.defer(seen.append, 1)
        pacer.defer(boom)
        pacer.defer(seen.append, 2)
        while len(pacer):
            await asyncio.sleep(0)
        return seen

    assert asyncio.run(main()) == [1, 2]
    assert "bug in one item" in caplog.text


def test_a_paced_connection_hands_out_what_came_before_the_close() -> None:
    """A worker that sends its last messages and exits: the batch a pacer
    still holds when the connection closes is handed out, in order."""

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        pacer = Pacer(budget_secs=0.0)  # one item a pass
        got: list[int] = []
        for _ in range(50):  # other work ahead: the close is seen first
            pacer.defer(lambda: None)
        ours, theirs = socket.socketpair()
        proto: FramedProtocol[m.Request] = FramedProtocol(
            msgspec.msgpack.Decoder(m.Request), on_message=lambda msg: got.append(msg.id), pacer=pacer
        )
        await loop.create_unix_connection(lambda: proto, sock=ours)
        theirs.sendall(b"".join(encode_frame(m.Ping(id=i)) for i in range(5)))
        theirs.close()
        await asyncio.wait_for(proto.closed, 5)
        deadline = time.monotonic() + 5
        while (len(pacer) or len(got) < 5) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_now_or_later_runs_at_once_only_with_nothing_ahead_and_budget_left() -> None:
    async def main() -> list[str]:
        pacer = Pacer(budget_secs=0.002)
        seen: list[str] = []
        pacer.now_or_later(seen.append, "at once")
        assert seen == ["at once"]
        pacer.now_or_later(lambda: time.sleep(0.003))  # spends this pass's budget
        pacer.now_or_later(seen.append, "over budget")
        assert seen == ["at once"] and len(pacer) == 1
        pacer.now_or_later(seen.append, "behind it")  # something is queued: keeps its order
        while len(pacer):
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # a new pass: the budget is back
        pacer.now_or_later(seen.append, "next pass")
        return seen

    assert asyncio.run(main()) == ["at once", "over budget", "behind it", "next pass"]
