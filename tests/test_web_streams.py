"""The web console's streams without a browser (component tier: the ASGI
side's generators on an event loop of the test's own)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.component


def test_a_page_that_goes_away_leaves_no_task_behind() -> None:
    """A page that closes its event stream (a reload, a closed tab) ends
    the stream's generator mid-wait: nothing of it may be left pending, or
    asyncio reports it on the console's stderr when it is collected ("Task
    was destroyed but it is pending!")."""
    import asyncio
    import gc
    from typing import Any

    from supervisor.ctl.web.app import _sse

    async def main() -> tuple[list[Any], list[str]]:
        said: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: said.append(str(ctx.get("message"))))

        async def feed(emit: Any) -> None:
            await asyncio.Event().wait()

        async def page() -> None:
            async for _ in _sse(feed, asyncio.Event()):
                pass

        reading = asyncio.create_task(page())
        for _ in range(5):
            await asyncio.sleep(0)
        reading.cancel()  # (as starlette does when the client disconnects)
        await asyncio.gather(reading, return_exceptions=True)
        for _ in range(5):
            await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        gc.collect()
        await asyncio.sleep(0)
        return left, said

    left, said = asyncio.run(main())
    assert left == [] and said == []
