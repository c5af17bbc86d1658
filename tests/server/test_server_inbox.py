"""The inbox an HTTP request's sequences receive their engine updates in."""

from __future__ import annotations

import asyncio

from ember.server.inbox import Inbox


def test_take_returns_everything_put_so_far_in_order():
    async def run() -> list[list[int]]:
        inbox: Inbox[int] = Inbox()
        for item in (1, 2, 3):
            inbox.put_nowait(item)
        first = await inbox.take()
        inbox.put_nowait(4)
        return [first, await inbox.take()]

    assert asyncio.run(run()) == [[1, 2, 3], [4]]


def test_take_waits_for_a_put():
    async def run() -> list[int]:
        inbox: Inbox[str] = Inbox()
        taking = asyncio.create_task(inbox.take())
        await asyncio.sleep(0)
        assert not taking.done()
        asyncio.get_running_loop().call_soon(inbox.put_nowait, "a")
        asyncio.get_running_loop().call_soon(inbox.put_nowait, "b")
        return await asyncio.wait_for(taking, 5)

    # Both puts ran before the reader resumed: it gets both at once.
    assert asyncio.run(run()) == ["a", "b"]


def test_a_cancelled_take_loses_nothing():
    async def run() -> list[int]:
        inbox: Inbox[int] = Inbox()
        taking = asyncio.create_task(inbox.take())
        await asyncio.sleep(0)
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)
        inbox.put_nowait(1)  # no reader waits: kept for the next take
        return await inbox.take()

    assert asyncio.run(run()) == [1]
