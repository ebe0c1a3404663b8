"""The buffered-claim pool: claimed rows waiting for a worker.

Bounded by `prefetch` unstarted rows. The fetcher fills it, workers drain it;
`drain()` empties it at once when a gate closes or the member stops, so those
rows can be released unstarted (no attempt, no reclaim charged).

Waking a thread costs more than a fast handler, so the pool wakes workers
lazily: a batch wakes one worker, and a worker that takes a row wakes another
only when the next row has already waited `HANDOFF_LAG`. Fast handlers are
then served by the few workers that are already awake; slow ones spread over
all workers within a few milliseconds (the fetcher, waiting for space, wakes
the next worker when every awake one is busy).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

HANDOFF_LAG = 0.001
"""Seconds a row may wait at the head of the pool before another worker is woken."""


class ClaimPool(Generic[T]):
    """A bounded FIFO of claimed rows shared by the fetcher and the workers."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.deque[tuple[float, T]] = collections.deque()
        self._lock = lock = threading.Lock()
        """The lock of both conditions: taken directly where no condition is waited on
        (a condition's `with` is two more Python calls, once per row in `take`)."""
        self._filled = threading.Condition(lock)
        self._emptied = threading.Condition(lock)
        self._closed = False
        self._sleeping = 0
        """Workers waiting in `take`: with none, nobody is notified (a notify is a
        Python call even when nobody waits)."""
        self._want = 1
        """Free slots the fetcher waits for: takes wake it only when they are there."""

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        """True once `shut()` or `close()` ran: no row is handed out any more."""
        return self._closed

    def put_many(self, items: Iterable[T]) -> None:
        """Add claimed rows (the fetcher never claims more than the free slots)."""
        now = time.monotonic()
        with self._filled:
            self._items.extend((now, item) for item in items)
            self._filled.notify()

    def take(self, timeout: float) -> T | None:
        """The oldest row, waiting up to `timeout`; None when empty or closed."""
        items = self._items
        with self._lock:
            if not items and not self._closed:
                self._sleeping += 1
                try:
                    self._filled.wait(timeout)
                finally:
                    self._sleeping -= 1
            if not items or self._closed:
                return None
            item = items.popleft()[1]
            if self._sleeping and items and time.monotonic() - items[0][0] >= HANDOFF_LAG:
                self._filled.notify()
            if self.capacity - len(items) == self._want:
                self._emptied.notify()
            return item

    def take_more(self, most: int) -> list[T]:
        """Up to `most` more rows at once, oldest first, without waiting (for a batch
        handler, after a `take`); none when closed."""
        items = self._items
        with self._lock:
            if self._closed:
                return []
            taken = [items.popleft()[1] for _ in range(min(most, len(items)))]
            if taken and self.capacity - len(items) >= self._want:
                self._emptied.notify()
            return taken

    def wait_for_space(self, want: int, timeout: float) -> int:
        """Wait until at least `want` slots are free (or `timeout`); return the free slots.

        While rows are waiting, it wakes every few milliseconds to wake another
        worker if the head row is overdue, so slow handlers do not leave rows sitting in the pool.
        """
        deadline = time.monotonic() + timeout
        with self._emptied:
            self._want = want
            while not self._closed and self.capacity - len(self._items) < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._emptied.wait(min(left, 0.005) if self._items else left)
                if self._items and time.monotonic() - self._items[0][0] >= HANDOFF_LAG:
                    self._filled.notify()
            return max(0, self.capacity - len(self._items))

    def resize(self, capacity: int) -> list[T]:
        """A new bound on buffered rows (an adaptive prefetch); returns the rows above
        it, the most recently claimed ones, removed for the caller to hand back."""
        with self._filled:
            self.capacity = capacity
            excess = []
            while len(self._items) > capacity:
                excess.append(self._items.pop()[1])
            self._emptied.notify_all()
            return excess[::-1]

    def drain(self) -> list[T]:
        """Remove and return every buffered row."""
        with self._filled:
            items = [item for _, item in self._items]
            self._items.clear()
            self._emptied.notify_all()
            return items

    def close(self) -> list[T]:
        """Stop handing out rows; return the ones still buffered."""
        self.shut()
        return self.drain()

    def shut(self) -> None:
        """Stop handing out rows and wake every waiter; buffered rows stay for `drain()`."""
        with self._filled:
            self._closed = True
            self._filled.notify_all()
            self._emptied.notify_all()

    def wake(self) -> None:
        """Wake every waiter (used on stop)."""
        with self._filled:
            self._filled.notify_all()
            self._emptied.notify_all()
