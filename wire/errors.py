"""The root of onnxps's exception tree, shared by the client and the wire layer.

The wire layer (codec, encodings) raises subclasses of ``OnnxpsError`` so that a
client's caller catches every onnxps error with one ``except``; the gRPC-status
errors (``RpcError`` and its subclasses) live with the client, which is the only
place that meets grpc statuses.
"""

from __future__ import annotations

__all__ = ["OnnxpsError"]


class OnnxpsError(Exception):
    """Base of every error the onnxps client raises."""
