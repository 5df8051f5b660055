"""The server's worker threads: a few busy threads take the calls in turn.

gRPC's sync server hands every call to its thread pool as the call arrives.
``concurrent.futures.ThreadPoolExecutor`` wakes an idle thread for each one (or
starts a new thread when none is idle at that instant), so under a steady load of
small calls every call costs a thread wake-up and, later, that thread's going back
to sleep: with the GIL, the wake-up preempts the thread that holds it, and these
switches cost more CPU than the call itself. ``HotPool`` lets at most ``hot`` threads
run short calls at once: a call arriving while they are all busy waits in a queue,
and the next of them to finish takes it without sleeping. Idle threads are kept on
a stack and the one that went idle last is woken first.

Calls that may hold a thread for long (streams, calls waiting for a version) are
not short: ``parked()`` counts them and they leave their place to another thread,
up to ``max_workers`` (the ``--threads`` budget that streams and waiting calls are
bounded by). Any other wait is caught by a watchdog: when the queue has not moved
for ``patience`` seconds, its first call gets a thread of its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from typing import Any

__all__ = ["PATIENCE_SECONDS", "HotPool", "hot_threads"]

# How long the queue may stand still before its first call gets a thread anyway.
PATIENCE_SECONDS = 0.1

# (its future, the function, its arguments, its keyword arguments)
_Item = tuple[
    "futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]
]


def hot_threads() -> int:
    """Threads running short calls at once: the CPUs, and at least 4."""
    return max(4, os.cpu_count() or 1)


class _Idle:
    """One idle thread: it sleeps on ``wake`` until a call is put in ``item``."""

    __slots__ = ("item", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.item: _Item | None = None  # None when woken: stop


class HotPool(futures.Executor):
    """At most ``max_workers`` threads, of which at most ``hot`` (plus those
    ``parked()`` counts) run calls at once while calls are queued."""

    def __init__(
        self,
        max_workers: int,
        thread_name_prefix: str = "pool",
        *,
        hot: int | None = None,
        parked: Callable[[], int] = lambda: 0,
        patience: float = PATIENCE_SECONDS,
    ) -> None:
        if max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        self.max_workers = max_workers
        self.hot = min(max_workers, hot or hot_threads())
        self.patience = patience
        self._parked = parked
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._idle: list[_Idle] = []
        self._queue: deque[_Item] = deque()
        self._threads: list[threading.Thread] = []
        self._busy = 0  # threads given a call, not yet idle again
        self._taken = 0  # calls taken off the queue so far
        self._shutdown = False
        self._watch = threading.Lock()  # released: the watchdog looks at the queue
        self._watch.acquire()
        self._watching = False
        self._watchdog: threading.Thread | None = None

    @property
    def thread_count(self) -> int:
        """Threads started so far (they end only at ``shutdown``)."""
        with self._lock:
            return len(self._threads)

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> futures.Future[Any]:
        future: futures.Future[Any] = futures.Future()
        item: _Item = (future, fn, args, kwargs)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._busy - self._parked() < self.hot:
                thread = self._dispatch(item)
            else:
                self._queue.append(item)
                thread = self._arm_watchdog()
        if thread is not None:
            thread.start()
        return future

    def _dispatch(self, item: _Item | None) -> threading.Thread | None:
        """Under the lock: hand ``item`` (None: the queue's first) to an idle
        thread, or to a new one (returned, to start) while the budget allows;
        else queue it."""
        if self._idle:
            idle = self._idle.pop()
            idle.item = item if item is not None else self._take()
            self._busy += 1
            idle.wake.release()
            return None
        if item is not None:
            self._queue.append(item)
        if len(self._threads) >= self.max_workers:
            return None
        self._busy += 1  # it takes the queue's first call
        return self._new_thread(self._work, f"{self._prefix}_{len(self._threads)}")

    def _new_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        return thread

    def _take(self) -> _Item:
        self._taken += 1
        return self._queue.popleft()

    def _work(self) -> None:
        me = _Idle()
        item: _Item | None = None
        while True:
            if item is not None:
                _run(item)
                item = None
            with self._lock:
                if self._queue:
                    item = self._take()
                    continue
                self._busy -= 1
                if self._shutdown:
                    return
                self._idle.append(me)
            me.wake.acquire()
            item, me.item = me.item, None
            if item is None:
                return

    # -- the watchdog ------------------------------------------------------------------
    def _arm_watchdog(self) -> threading.Thread | None:
        """Under the lock: have the watchdog look at the queue (a new watchdog
        thread to start, the first time)."""
        if self._watching:
            return None
        self._watching = True
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_queue, name=f"{self._prefix}-watch", daemon=True
            )
            return self._watchdog
        self._watch.release()
        return None

    def _watch_queue(self) -> None:
        """While calls are queued: every ``patience``, when none was taken since
        the last look, give the first one a thread; sleep while none is queued."""
        while True:
            with self._lock:
                taken = self._taken
            time.sleep(self.patience)
            started = None
            with self._lock:
                if self._shutdown:
                    return
                disarmed = not self._queue
                if disarmed:  # the next call queued releases ``_watch`` once
                    self._watching = False
                elif self._taken == taken:
                    started = self._dispatch(None)
            if started is not None:
                started.start()
            if disarmed:
                self._watch.acquire()  # then the loop's first look sees a shutdown

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            again, self._shutdown = self._shutdown, True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
            idle, self._idle = self._idle, []
            threads = list(self._threads)
            if self._watchdog is not None and not self._watching and not again:
                self._watch.release()
        for sleeper in idle:
            sleeper.wake.release()  # item None: stop
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


def _run(item: _Item) -> None:
    future, fn, args, kwargs = item
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the future carries it
        future.set_exception(exc)
    else:
        future.set_result(result)
