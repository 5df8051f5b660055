"""MkDocs hooks (``hooks:`` in mkdocs.yml) for the API reference.

mkdocstrings (griffe) finds packages on its search paths, and cannot follow
setuptools' ``package-dir`` mapping (``client`` -> ``onnxps.client``). At start-up
this lays out the packages the reference reads (the client, and the wire layer and
generated messages it imports) as symlinks under ``build/api-src``, the path
mkdocs.yml gives the python handler. The command line and the server are left out:
the handler imports what it inspects, and ``onnxps.cli.__main__`` would run.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "api-src"
PACKAGES = ("onnxps.client", "onnxps.wire", "onnxps.v1")


def on_startup(**_: Any) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from typecheck import package_dirs
    finally:
        sys.path.pop(0)
    dirs = package_dirs(ROOT)
    shutil.rmtree(TREE, ignore_errors=True)
    (TREE / "onnxps").mkdir(parents=True)
    for name in PACKAGES:
        link = TREE.joinpath(*name.split("."))
        link.symlink_to(dirs[name], target_is_directory=True)
