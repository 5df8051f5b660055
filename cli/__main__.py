"""``python -m onnxps.cli``: the ``onnxps`` command."""

import sys

from ._main import main

sys.exit(main())
