"""The scheduler's waiting queue, one of two orders (vLLM's ``--scheduling-policy``):

- ``fcfs``: arrival order; a request put back (preempted, its KV arrived, skipped this step) goes to the head.
- ``priority``: lowest ``Request.priority`` first, ties by arrival time (then by the order added). A request
  put back takes its place by the same key, so a preempted request resumes before later arrivals of its
  priority and after every waiting request of a higher one.

Pure Python, no torch.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from tokenmill.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class FCFSQueue:
    """Arrival order (a deque)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """A new arrival: at the tail."""
        self._queue.append(request)

    def put_back(self, requests: list[Request]) -> None:
        """Requests taken from the head (in the order taken), back to the head in that order."""
        self._queue.extendleft(reversed(requests))

    def peek(self) -> Request:
        """The next request to schedule (IndexError when empty)."""
        return self._queue[0]

    def pop(self) -> Request:
        """Remove and return ``peek()``."""
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Take ``request`` out wherever it is (ValueError when absent)."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """A heap keyed by (priority, arrival_time, order added): lower priority values first, ties FCFS.

    ``remove`` marks the entry dead (skipped by ``peek``/``pop``) instead of re-heapifying: O(log n) per
    operation, amortised.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[int, int] = {}  # id(request) -> its live entry's sequence number
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        """Queue ``request`` by its key."""
        seq = next(self._counter)
        self._live[id(request)] = seq
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    def put_back(self, requests: list[Request]) -> None:
        """Requests taken from the head, queued again by their keys (which puts them back where they were)."""
        for request in requests:
            self.add(request)

    def _prune(self) -> None:
        heap = self._heap
        while heap and self._live.get(id(heap[0][3])) != heap[0][2]:
            heapq.heappop(heap)

    def peek(self) -> Request:
        """The next request to schedule (IndexError when empty)."""
        self._prune()
        return self._heap[0][3]

    def pop(self) -> Request:
        """Remove and return ``peek()``."""
        self._prune()
        request = heapq.heappop(self._heap)[3]
        del self._live[id(request)]
        return request

    def remove(self, request: Request) -> None:
        """Take ``request`` out (ValueError when absent)."""
        if self._live.pop(id(request), None) is None:
            raise ValueError(f"{request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        """Live requests in scheduling order."""
        live = [entry for entry in self._heap if self._live.get(id(entry[3])) == entry[2]]
        return iter(entry[3] for entry in sorted(live, key=lambda e: e[:3]))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The waiting queue of ``policy`` (one of ``SCHEDULING_POLICIES``).

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; one of {SCHEDULING_POLICIES}")
