"""The L2 adapter's task plumbing: LMCache's submit / event fd / pop-or-query protocol.

Each ``submit_*`` of the adapter returns a task id at once and runs the task on a worker
thread; when it completes, its result is kept for the controller and that operation's event
fd is signalled (three distinct fds, polled by LMCache's store and prefetch controllers).
Store results are popped all at once (``pop_completed_store_tasks``); lookup and load
results are answered once per task (``query_*_result``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.platform import create_event_notifier

from kvprefetch.agents.stores.errors import StoreError

log = logging.getLogger(__name__)


class L2Tasks:
    """Task ids, worker threads, completed results and their event fds. Thread-safe.

    ``workers`` threads run store and load tasks; lookups run on a thread of their own, so
    they never queue behind loads and stores (they gate every request's prefill).
    ``around_task`` wraps every task (e.g. the write-back uploads' foreground window).
    """

    def __init__(self, workers: int,
                 around_task: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self._around = around_task
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self._stores_done: dict[int, L2StoreResult] = {}
        self._lookups_done: dict[int, Bitmap] = {}
        self._loads_done: dict[int, Bitmap] = {}
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvp-l2")
        self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="kvp-l2-lookup")

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    # -- event fds ---------------------------------------------------------------------------

    def store_fd(self) -> int:
        return int(self._store_fd.fileno())

    def lookup_fd(self) -> int:
        return int(self._lookup_fd.fileno())

    def load_fd(self) -> int:
        return int(self._load_fd.fileno())

    # -- submit ------------------------------------------------------------------------------

    def submit(self, what: str, work: Callable[[int], None], fail: Callable[[int], None],
               *, lookup: bool = False) -> int:
        """Queue ``work(task_id)`` on a worker (the lookup thread with ``lookup``) and return
        the id at once. If ``work`` raises, ``fail(task_id)`` publishes an all-failed result:
        the controller hears back about every task. Raises :class:`StoreError` once closed."""

        def guarded(task_id: int) -> None:
            try:
                with self._around():
                    work(task_id)
            except Exception:
                log.exception("kvprefetch L2 %s task %d failed", what, task_id)
                fail(task_id)

        with self._lock:
            if self._closed:
                raise StoreError(f"kvprefetch L2 adapter is closed ({what} refused)")
            task_id = next(self._ids)
            (self._lookup_pool if lookup else self._pool).submit(guarded, task_id)
        return task_id

    # -- results -----------------------------------------------------------------------------

    def publish_store(self, task_id: int, result: L2StoreResult) -> None:
        with self._lock:
            self._stores_done[task_id] = result
        self._store_fd.notify()

    def publish_lookup(self, task_id: int, bitmap: Bitmap) -> None:
        with self._lock:
            self._lookups_done[task_id] = bitmap
        self._lookup_fd.notify()

    def publish_load(self, task_id: int, bitmap: Bitmap) -> None:
        with self._lock:
            self._loads_done[task_id] = bitmap
        self._load_fd.notify()

    def pop_stores(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

    def pop_lookup(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def pop_load(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    # -- lifecycle ---------------------------------------------------------------------------

    def refuse(self) -> bool:
        """Refuse new tasks from now on; False if already refused (close is idempotent)."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def finish(self) -> None:
        """Let the running tasks finish; queued ones are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._lookup_pool.shutdown(wait=True, cancel_futures=True)

    def release(self) -> None:
        """Stop the workers without waiting and close the event fds."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        for fd in (self._store_fd, self._lookup_fd, self._load_fd):
            fd.close()
