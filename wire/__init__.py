"""The wire layer both ends share: what a tensor, a group and a segment look like in
transit and at rest, with no grpc and nothing of either end.

- ``codec``: tensors to and from ``onnxps.v1.Tensor`` (chunks, frames, assembly).
- ``encoding``: the 2-byte wire encodings (bfloat16, float16) and their checks.
- ``image``: a group's saved form (snapshots, the WAL, export files).
- ``frames``: the data and call channels' frames; ``replies``: a Push or Pull reply's
  tensors read where they were received (no protobuf copy).
- ``initializers``: how an ids table makes a new row.
- ``shm``: the layout of a shared-memory segment and its naming and sweeping rules.
- ``weights``, ``onnx_weights``: model weights files (.safetensors; an ONNX model's
  initializers, written back in place), for ``export`` and ``import``.
- ``errors``: ``OnnxpsError``, the root of the exception tree.

The client (``onnxps.client``) and the server (``onnxps.server``) import this package;
it imports neither of them.
"""
