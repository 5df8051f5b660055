"""The ``onnxps`` command: ``serve`` (run by ``onnxps.server.cli``) and the commands
that act as clients of a running server (``status``, ``export``, ``import``,
``demo``)."""

from ._main import main

__all__ = ["main"]
