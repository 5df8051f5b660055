"""A mistake in using the client is a TypeError/ValueError that says what to pass,
or a typed onnxps error with a message; never a raw Python error from inside."""

from __future__ import annotations

import numpy as np
import pytest
from onnxps.client import (
    Adam,
    Client,
    DeadlineExceededError,
    OnnxpsError,
    Sync,
    TensorFormatError,
)
from onnxps.server.app import ServerHandle

W = np.zeros((2, 3), np.float32)
B = np.zeros(3, np.float32)


def test_client_with_tensors_instead_of_an_address() -> None:
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) tensors: it takes"):
        Client(tensors=[W, B])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the server's 'host:port' as a string"):
        Client()
    with pytest.raises(TypeError, match=r"tensors are given to create_group\(\)"):
        Client("127.0.0.1:1", tensors=[W, B])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the server's 'host:port' as a string"):
        Client([W, B])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"timeout": 0}, ValueError, "timeout must be > 0 seconds, got 0"),
        ({"timeout": "5"}, TypeError, "timeout is seconds"),
        ({"transport": "udp"}, ValueError, "transport must be one of auto, unary"),
        ({"chunk_bytes": 0}, ValueError, "chunk_bytes must be an integer >= 1"),
        ({"root_certificates": "ca.pem"}, TypeError, "not a path"),
    ],
)
def test_client_options_are_checked(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Client("127.0.0.1:1", **kwargs)  # type: ignore[arg-type]


def test_create_group_with_the_optimizer_class(client: Client) -> None:
    with pytest.raises(TypeError, match=r"e\.g\. Adam\(\), not the class Adam"):
        client.create_group("g", Adam, learning_rate=0.1, tensors={"w": W})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be one of Adagrad\(\)"):
        client.create_group("g", "adam", learning_rate=0.1, tensors={"w": W})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"e\.g\. Sync\(\), not the class Sync"):
        client.create_group(
            "g",
            Adam(),
            learning_rate=0.1,
            tensors={"w": W},
            consistency=Sync,  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match=r"not the class Adam"):
        client.apply(Adam, 0.1, 0, W, W, W, W)  # type: ignore[arg-type]
    assert client.list_groups() == []


def test_create_group_with_unnamed_tensors(client: Client) -> None:
    with pytest.raises(TypeError, match=r"tensors must name each tensor"):
        client.create_group("g", Adam(), learning_rate=0.1, tensors=[W, B])  # type: ignore[list-item]


def test_tensor_format_error_is_an_onnxps_error() -> None:
    assert issubclass(TensorFormatError, OnnxpsError)
    assert issubclass(TensorFormatError, ValueError)


def test_pull_min_version_says_what_it_waited_for(
    server: ServerHandle, client: Client
) -> None:
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W})
    with pytest.raises(DeadlineExceededError) as err:
        client.pull("g", min_version=5, timeout=0.5)
    text = str(err.value)
    # The server answers a little before the deadline, saying where T is; on a loaded
    # machine the client's own deadline can still fire first.
    assert text.startswith("DEADLINE_EXCEEDED: group g did not reach T=5 within 0.5 s")
    rest = text.removeprefix(
        "DEADLINE_EXCEEDED: group g did not reach T=5 within 0.5 s"
    )
    assert rest == "" or rest.startswith(" ("), text
