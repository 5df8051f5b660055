"""The server's worker pool: a few threads take short calls in turn; calls that
hold a thread for long leave their place; a queue that stands still is served."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest
from onnxps.server._pool import HotPool, hot_threads

LONG = 60.0  # a patience no test waits for: the watchdog stays out of the way


def test_a_steady_load_of_short_calls_runs_on_the_hot_threads_only() -> None:
    pool = HotPool(64, "t", hot=2, patience=LONG)
    submitted: list[futures.Future[int]] = []
    lock = threading.Lock()

    def submitter(k: int) -> None:
        for i in range(50):
            f = pool.submit(lambda k=k, i=i: k * 1000 + i)
            with lock:
                submitted.append(f)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = sorted(f.result(timeout=30) for f in submitted)
    assert got == sorted(k * 1000 + i for k in range(8) for i in range(50))
    assert pool.thread_count <= 2  # a ThreadPoolExecutor(64) starts more
    pool.shutdown()


def test_a_parked_call_leaves_its_place_to_another_thread() -> None:
    parked = [0]
    pool = HotPool(8, "t", hot=1, parked=lambda: parked[0], patience=LONG)
    started, release = threading.Event(), threading.Event()

    def waiting_call() -> str:
        parked[0] += 1  # as a stream or a call waiting for a version counts itself
        started.set()
        try:
            release.wait(timeout=30)
            return "waited"
        finally:
            parked[0] -= 1

    held = pool.submit(waiting_call)
    assert started.wait(timeout=30)
    # the one hot thread is parked: the next call runs at once, not after LONG
    assert pool.submit(lambda: 7).result(timeout=30) == 7
    release.set()
    assert held.result(timeout=30) == "waited"
    assert pool.thread_count == 2
    pool.shutdown()


def test_a_call_queued_behind_a_blocked_thread_gets_a_thread_after_patience() -> None:
    pool = HotPool(8, "t", hot=1, patience=0.01)
    started, release = threading.Event(), threading.Event()

    def blocked() -> None:  # blocks without counting itself parked
        started.set()
        release.wait(timeout=30)

    held = pool.submit(blocked)
    assert started.wait(timeout=30)
    assert pool.submit(lambda: 7).result(timeout=30) == 7  # the watchdog's thread
    release.set()
    held.result(timeout=30)
    pool.shutdown()


def test_no_more_threads_than_max_workers_and_errors_reach_the_future() -> None:
    parked = [0]
    pool = HotPool(2, "t", hot=2, parked=lambda: parked[0], patience=0.01)
    release = threading.Event()
    both = threading.Barrier(3)

    lock = threading.Lock()

    def blocked() -> None:
        with lock:
            parked[0] += 1
        both.wait(timeout=30)
        release.wait(timeout=30)
        with lock:
            parked[0] -= 1

    held = [pool.submit(blocked) for _ in range(2)]
    both.wait(timeout=30)  # both threads of the budget are held
    queued = pool.submit(lambda: 1 / 0)
    assert not queued.done()
    release.set()
    with pytest.raises(ZeroDivisionError):
        queued.result(timeout=30)
    for f in held:
        f.result(timeout=30)
    assert pool.thread_count == 2
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 1)


def test_hot_threads_is_the_cpus_and_at_least_4() -> None:
    import os

    assert hot_threads() == max(4, os.cpu_count() or 1)
    assert HotPool(3, "t").hot == 3  # never more than the budget
    assert HotPool(8, "t").patience == 0.1  # docs/configuration.md: 100 ms
