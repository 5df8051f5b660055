"""A graceful stop does not wait out its grace for calls that can no longer finish."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from onnxps.client import Adagrad, Client, Sync, UnavailableError
from onnxps.server.app import ServerHandle


@pytest.mark.slow
def test_stop_releases_waiting_pulls_and_sync_pushes_with_unavailable(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers()
    outcomes: dict[str, BaseException | None] = {}
    with Client(handle.address, timeout=20) as c:
        x = np.zeros(3, np.float32)
        c.create_group("a", Adagrad(), learning_rate=0.1, tensors={"x": x})
        c.create_group(
            "s", Adagrad(), learning_rate=0.1, tensors={"x": x}, consistency=Sync(2)
        )

        def run(name: str, call: object) -> None:
            try:
                call()  # type: ignore[operator]
                outcomes[name] = None
            except BaseException as exc:  # noqa: BLE001 - recorded for the asserts
                outcomes[name] = exc

        threads = [
            threading.Thread(
                target=run, args=("pull", lambda: c.pull("a", min_version=5))
            ),
            threading.Thread(
                target=run,
                args=(
                    "push",
                    # resent until its deadline while the server is gone
                    lambda: c.push(
                        "s", np.ones(3, np.float32), return_values=True, timeout=5
                    ),
                ),
            ),
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while handle.store.waiting_calls < 2:
            assert time.monotonic() < deadline, "the two calls never waited"
            time.sleep(0.01)
        # A grace far longer than the test may take: stop must not wait it out.
        stopper = threading.Thread(target=handle.stop, args=(600.0,), daemon=True)
        stopper.start()
        stopper.join(timeout=60)
        assert not stopper.is_alive(), "stop waited out its grace for stuck calls"
        for t in threads:
            t.join(timeout=30)
    assert isinstance(outcomes["pull"], UnavailableError)
    assert isinstance(outcomes["push"], UnavailableError)
