"""Where the engine client drops the updates of one HTTP request's sequences, and where its
handler takes all that have arrived at once.

Not an `asyncio.Queue`: a put per streamed token went through the queue's bound checks, its
deque of waiting futures and its loop check, and a get re-armed a future each time; with one
reader and no bound, a list and one waiting future do the same work.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    """An unbounded mailbox with one reader, on the running event loop."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self) -> None:
        self._items: list[T] = []
        # Looked up once: `get_running_loop` makes a getpid() system call each time.
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        """Add `item` and wake the reader (never blocks)."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[T]:
        """Every item put since the last take, oldest first; waits until there is one."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items
