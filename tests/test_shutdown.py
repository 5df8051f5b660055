"""A graceful stop does not wait out its grace for calls that can no longer finish."""

from __future__ import annotations

import threading
import time

import numpy as np
from onnxps.client import Adagrad, Client, Sync, UnavailableError
from onnxps.server.app import ServerConfig, create_server


def test_stop_releases_waiting_pulls_and_sync_pushes_with_unavailable() -> None:
    handle = create_server(
        ServerConfig(address="127.0.0.1:0", durability="none")
    ).start()
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
        time.sleep(0.5)
        start = time.monotonic()
        handle.stop(grace=10.0)
        stop_seconds = time.monotonic() - start
        for t in threads:
            t.join(timeout=15)
    assert stop_seconds < 3.0, f"stop waited {stop_seconds:.1f} s for stuck calls"
    assert isinstance(outcomes["pull"], UnavailableError)
    assert isinstance(outcomes["push"], UnavailableError)
