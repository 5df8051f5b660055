"""``python -m onnxps.cli``: the ``onnxps`` command."""

import sys

from ._main import main

if __name__ == "__main__":  # importing it (a docs build inspects it) runs nothing
    sys.exit(main())
