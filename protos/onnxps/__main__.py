"""``python -m onnxps``: the ``onnxps`` command.

``onnxps`` is a namespace package made of portions mapped from several folders; this
file is its one top-level module, mapped from the folder the package tree starts in.
"""

import sys

from onnxps.cli import main

if __name__ == "__main__":  # importing it (a docs build inspects it) runs nothing
    sys.exit(main())
