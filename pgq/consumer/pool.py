"""The buffered-claim pool: claimed rows waiting for a worker.

Bounded by `prefetch` unstarted rows. The fetcher fills it, workers drain it;
`drain()` empties it at once when a gate closes or the member stops, so those
rows can be released unstarted (no attempt, no reclaim charged).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class ClaimPool(Generic[T]):
    """A bounded FIFO of claimed rows shared by the fetcher and the workers."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        lock = threading.Lock()
        self._filled = threading.Condition(lock)
        self._emptied = threading.Condition(lock)
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def free(self) -> int:
        """How many more rows the pool may take now."""
        return max(0, self.capacity - len(self._items))

    def put_many(self, items: Iterable[T]) -> None:
        """Add claimed rows (the fetcher never claims more than `free()`)."""
        with self._filled:
            self._items.extend(items)
            self._filled.notify(len(self._items))

    def take(self, timeout: float) -> T | None:
        """The oldest row, waiting up to `timeout`; None when empty or closed."""
        with self._filled:
            if not self._items and not self._closed:
                self._filled.wait(timeout)
            if self._items and not self._closed:
                item = self._items.popleft()
                self._emptied.notify()
                return item
            return None

    def wait_for_space(self, want: int, timeout: float) -> int:
        """Wait until at least `want` slots are free (or `timeout`); return the free slots."""
        with self._emptied:
            self._emptied.wait_for(
                lambda: self._closed or self.capacity - len(self._items) >= want, timeout
            )
            return max(0, self.capacity - len(self._items))

    def drain(self) -> list[T]:
        """Remove and return every buffered row."""
        with self._filled:
            items = list(self._items)
            self._items.clear()
            self._emptied.notify_all()
            return items

    def close(self) -> list[T]:
        """Stop handing out rows; return the ones still buffered."""
        with self._filled:
            self._closed = True
            self._filled.notify_all()
        return self.drain()

    def wake(self) -> None:
        """Wake every waiter (used on stop)."""
        with self._filled:
            self._filled.notify_all()
            self._emptied.notify_all()
