"""``python -m onnxps.server.kernels``: compile numba's fused kernels (and the
2-byte encodings' loops, ``onnxps.wire.encoding``) into its on-disk cache now, so
that servers started later load them (about 1 s) instead of compiling them (2 to
20 s). The cache is ``NUMBA_CACHE_DIR`` when set, else ``__pycache__`` next to this
package when writable, else the user's cache directory; the line printed says which.
The Dockerfile runs this at build. The row kernels compile at a group's first row
push instead (their types are the push's).

Exit status 0 when the kernels are in the cache, 1 when numba cannot give them or
has no writable cache directory.
"""

from __future__ import annotations

import logging
import sys

from onnxps.wire.encoding import compiled_codec

from . import _select


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernels = _select.fused_kernels()
    if kernels is None:
        print(f"onnxps: no fused kernels: {_select._failure}", file=sys.stderr)
        return 1
    if compiled_codec() is None:
        print("onnxps: no compiled encoding loops", file=sys.stderr)
        return 1
    from ._numba import cache_note

    return 1 if "no writable" in cache_note(kernels) else 0


if __name__ == "__main__":
    sys.exit(main())
