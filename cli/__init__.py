"""The ``onnxps`` command: ``serve`` (run by ``onnxps.server.cli``) and the commands
that act as clients of a running server (``status``, ``export``, ``import``,
``demo``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``onnxps`` command. Its modules load on call, so that ``python -m
    onnxps.cli._demo_worker`` does not find itself imported by its own package."""
    from ._main import main as run

    return run(argv)
