"""The Python client outlives the daemon (supervisor.ctl.client), against a
control socket played by the test: each connection follows a script of
what a daemon that went away and came back would say.  What a real daemon
does across a SIGKILL is in tests/test_reconnect_e2e.py; here, each
promise on its own, in milliseconds: a turn followed across a restart
from the last event seen (the input never sent twice), a turn whose end
was not retained read back from history, an input never acknowledged, a
session gone, a daemon that does not come back, a client cut off for
lagging."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ipc import messages as m
from ipc import operator as op
from ipc.framing import encode_frame
from supervisor.ctl.client import AsyncClient, DaemonUnavailable, InputUnacknowledged, RequestError
from polling import until

pytestmark = pytest.mark.protocol

_requests = msgspec.msgpack.Decoder(op.AnyRequest)


class Conn:
    """One client connection, as the fake daemon sees it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def recv(self) -> Any:
        head = await self.reader.readexactly(4)
        return _requests.decode(await self.reader.readexactly(int.from_bytes(head, "big")))

    def send(self, *msgs: Any) -> None:
        for msg in msgs:
            self.writer.write(encode_frame(msg))

    async def hello(self, pid: int) -> None:
        assert isinstance(await self.recv(), m.Hello)
        self.send(m.Welcome(protocol=m.PROTOCOL_VERSION, server_version="fake", pid=pid))


Script = Callable[[Conn], Awaitable[None]]


class FakeDaemon:
    """A control socket that runs `scripts` in order, one per connection;
    `down()` takes the socket away (a daemon gone), `up()` brings it back."""

    def __init__(self, path: Path, scripts: list[Script]) -> None:
        self.path = path
        self.scripts = scripts
        self.seen: list[Any] = []  # every request every connection sent
        self.server: asyncio.AbstractServer | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def up(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, str(self.path))

    async def down(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(reader, writer)
        recv = conn.recv

        async def noted() -> Any:
            msg = await recv()
            self.seen.append(msg)
            return msg

        conn.recv = noted  # type: ignore[method-assign]
        script = self.scripts.pop(0)
        try:
            await script(conn)
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def fake(scripts: list[Script]):  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory(prefix="sd-") as tmp:
        d = FakeDaemon(Path(tmp) / "s.sock", scripts)
        await d.up()
        try:
            yield d
        finally:
            if d.server is not None:
                d.server.close()


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 20))




def _kinds(events: list[Any]) -> list[str]:
    return [type(e).__name__ for e in events]


def test_a_turn_is_followed_across_a_restart_from_the_last_event_seen() -> None:
    went_away = asyncio.Event()

    async def first(c: Conn) -> None:
        await c.hello(pid=1)
        send = await c.recv()
        assert isinstance(send, m.Send)
        c.send(m.Accepted(id=send.id, session="s", turn=3, seq=10),
               m.TextDelta(session="s", seq=11, turn=3, text="par"))
        await c.writer.drain()
        went_away.set()  # the daemon dies here

    async def second(c: Conn) -> None:
        await c.hello(pid=2)
        attach = await c.recv()
        assert isinstance(attach, m.Attach) and attach.from_seq == 12  # from the event after the last seen
        c.send(m.Attached(id=attach.id, session="s", next_seq=4100),
               m.Gap(session="s", seq=4097, from_seq=12),
               m.Notice(session="s", seq=4097, turn=3, kind="turn_resumed", data={"step": 1}),
               m.TextDelta(session="s", seq=4098, turn=3, text="tial"))
        history = await c.recv()
        assert isinstance(history, op.History)
        c.send(op.HistoryReply(id=history.id, session="s", turns=[op.HistoryTurn(turn=3, input="x")]))
        c.send(m.TurnDone(session="s", seq=4099, turn=3, reply="partial"))
        await c.recv()  # (until the client goes)

    async def body() -> None:
        notes: list[str] = []
        async with fake([first, second]) as d:
            client = await AsyncClient.connect(d.path, on_reconnect=notes.append, reconnect_secs=10)
            events: list[Any] = []

            async def follow() -> None:
                async for ev in client.send("s", "x"):
                    events.append(ev)

            task = asyncio.ensure_future(follow())
            await went_away.wait()
            await d.down()
            await until(lambda: notes)  # it noticed, and waits
            await d.up()
            await task
            assert _kinds(events) == ["TextDelta", "Gap", "Notice", "TextDelta", "TurnDone"]
            assert events[-1].reply == "partial" and client.server_pid == 2
            assert [type(r).__name__ for r in d.seen] == ["Hello", "Send", "Hello", "Attach", "History"]
            assert notes[0].startswith("connection to sessiond lost; reconnecting for up to 10s")
            assert notes[-1] == "reconnected to sessiond (pid 2)"
            await client.close()

    run(body)


@pytest.mark.parametrize("stored, expected", [
    (op.HistoryTurn(turn=3, input="x", outcome="done", reply="whole", stop_reason="truncated"),
     m.TurnDone(session="s", seq=0, turn=3, reply="whole", stop_reason="truncated")),
    (op.HistoryTurn(turn=3, input="x", outcome="aborted", reason="the daemon stopped during this turn"),
     m.TurnFailed(session="s", seq=0, turn=3, reason="the daemon stopped during this turn")),
])
def test_a_turn_whose_end_was_not_retained_ends_as_its_history_says(stored: op.HistoryTurn, expected: Any) -> None:
    async def first(c: Conn) -> None:
        await c.hello(pid=1)
        send = await c.recv()
        c.send(m.Accepted(id=send.id, session="s", turn=3, seq=10))

    async def second(c: Conn) -> None:
        await c.hello(pid=2)
        attach = await c.recv()
        # Nothing of the turn retained; an unrelated event is.
        c.send(m.Attached(id=attach.id, session="s", next_seq=4100),
               m.Gap(session="s", seq=4097, from_seq=11),
               m.StateChanged(session="s", seq=4097, old="hibernated", new="starting"))
        history = await c.recv()
        c.send(op.HistoryReply(id=history.id, session="s", turns=[
            op.HistoryTurn(turn=2, input="before", outcome="done", reply="old"), stored]))
        await c.recv()

    async def body() -> None:
        async with fake([first, second]) as d:
            client = await AsyncClient.connect(d.path, reconnect_secs=10)
            events = [ev async for ev in client.send("s", "x")]
            assert _kinds(events) == ["Gap", "StateChanged", type(expected).__name__]
            assert events[-1] == expected  # seq 0: read back, not an event the daemon sent
            await client.close()

    run(body)


def test_an_input_never_acknowledged_is_said_and_never_sent_again() -> None:
    async def first(c: Conn) -> None:
        await c.hello(pid=1)
        assert isinstance(await c.recv(), m.Send)  # then it dies, before Accepted

    async def second(c: Conn) -> None:
        await c.hello(pid=2)
        ping = await c.recv()
        c.send(m.Pong(id=ping.id, pid=2))
        await c.recv()

    async def body() -> None:
        async with fake([first, second]) as d:
            client = await AsyncClient.connect(d.path, reconnect_secs=10)
            with pytest.raises(InputUnacknowledged, match="may or may not have been taken"):
                async for _ in client.send("s", "x"):
                    pass
            # The client goes on (a new connection), and the input went once.
            assert (await client.ping()).pid == 2
            assert [type(r).__name__ for r in d.seen] == ["Hello", "Send", "Hello", "Ping"]
            await client.close()

    run(body)


def test_a_daemon_back_without_the_session_is_not_found() -> None:
    async def first(c: Conn) -> None:
        await c.hello(pid=1)
        attach = await c.recv()
        c.send(m.Attached(id=attach.id, session="s", next_seq=5))

    async def second(c: Conn) -> None:
        await c.hello(pid=2)
        attach = await c.recv()
        assert attach.from_seq == 5
        c.send(m.Error(id=attach.id, code=m.ErrorCode.NOT_FOUND, message="no session 's'"))
        await c.recv()

    async def body() -> None:
        async with fake([first, second]) as d:
            client = await AsyncClient.connect(d.path, reconnect_secs=10)
            with pytest.raises(RequestError) as exc:
                async for _ in client.attach("s"):
                    pass
            assert exc.value.code == "not_found"
            await client.close()

    run(body)


def test_a_daemon_that_does_not_come_back_is_a_clear_error_after_the_wait() -> None:
    async def first(c: Conn) -> None:
        await c.hello(pid=1)
        send = await c.recv()
        c.send(m.Accepted(id=send.id, session="s", turn=1, seq=1))

    async def body() -> None:
        async with fake([first]) as d:
            client = await AsyncClient.connect(d.path, reconnect_secs=0.3)
            stream = client.send("s", "x")
            await d.down()  # (the first connection ends with the script: the socket is gone by then)
            with pytest.raises(DaemonUnavailable, match=r"did not come back within 0.3s.*turn 1 of s goes on"):
                async for _ in stream:
                    pass
            await client.close()

    run(body)


def test_no_reconnecting_when_it_is_off() -> None:
    async def first(c: Conn) -> None:
        await c.hello(pid=1)
        attach = await c.recv()
        c.send(m.Attached(id=attach.id, session="s", next_seq=5))

    async def body() -> None:
        async with fake([first]) as d:
            client = await AsyncClient.connect(d.path, reconnect_secs=0)
            with pytest.raises(DaemonUnavailable, match="lost"):
                async for _ in client.attach("s"):
                    pass
            await client.close()

    run(body)


def test_a_client_cut_off_for_lagging_attaches_again_from_where_it_was() -> None:
    async def first(c: Conn) -> None:
        await c.hello(pid=1)
        attach = await c.recv()
        c.send(m.Attached(id=attach.id, session="s", next_seq=5),
               m.TextDelta(session="s", seq=5, turn=1, text="a"),
               m.Lagged(dropped=100))
        await c.writer.drain()
        await asyncio.sleep(30)  # the daemon keeps it open a while; the client goes at once

    async def second(c: Conn) -> None:
        await c.hello(pid=1)
        attach = await c.recv()
        assert attach.from_seq == 6
        c.send(m.Attached(id=attach.id, session="s", next_seq=9),
               m.TextDelta(session="s", seq=6, turn=1, text="b"),
               m.StateChanged(session="s", seq=7, old="idle", new="deleted"))
        await c.recv()

    async def body() -> None:
        async with fake([first, second]) as d:
            client = await AsyncClient.connect(d.path, reconnect_secs=10)
            events = [ev async for ev in client.attach("s")]
            assert [getattr(e, "text", getattr(e, "new", "")) for e in events] == ["a", "b", "deleted"]
            await client.close()

    run(body)


def test_a_daemon_that_does_not_answer_hello_in_time_leaves_no_unread_error() -> None:
    """A daemon still starting (one that loads before it listens) takes the
    connection and answers late: the client gives up with DaemonUnavailable,
    and nothing more (its hello's answer, failed by the close, was once left
    unread: "Future exception was never retrieved" on every try)."""
    from supervisor.ctl.dial import open_connection

    async def silent(c: Conn) -> None:
        await c.recv()  # the hello
        await asyncio.sleep(30)

    async def body() -> None:
        unread: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context))
        async with fake([silent]) as d:
            with pytest.raises(DaemonUnavailable, match="did not answer hello"):
                await open_connection(str(d.path), client_name="t", reasoning=False, timeout=0.2,
                                      on_message=lambda msg: None, on_close=lambda proto, exc: None)
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)
        assert [c.get("message") for c in unread] == []

    run(body)
