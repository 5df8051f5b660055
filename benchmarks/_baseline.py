"""An A/B benchmark's two sides as separate checkouts of onnxps, each in its own
processes: the baseline is an older commit, never a switch in production code.

``checkout(rev)`` extracts a commit (``git archive``) into a temporary folder and
lays its package-dir mapping (read from *that* commit's pyproject.toml) out as a
tree of symlinks, like ``scripts/typecheck.py`` does for mypy; ``checkout(None)`` lays
out this working tree the same way. With the tree first on ``PYTHONPATH`` a process
imports onnxps as that checkout has it: ``tree_env`` gives that environment (for
``onnxps serve``) and ``Worker`` runs a script there, driven over a pipe, one JSON
request and one JSON answer a line.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from typecheck import build_tree  # noqa: E402

# Modules a checkout must import from its own files (not from an installed onnxps).
_OWN = ("onnxps.client", "onnxps.server.app", "onnxps.cli")


@dataclass(frozen=True)
class Checkout:
    """A checkout laid out for import: ``tree`` goes on PYTHONPATH; ``label``
    names it in reports (a short commit, ``+`` if the working tree differs)."""

    tree: Path
    source: Path
    label: str


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def describe(rev: str | None) -> str:
    """``SHORT subject`` of ``rev`` (None: HEAD, with ``+`` if the tree is dirty)."""
    commit = _git("rev-parse", "--verify", f"{rev or 'HEAD'}^{{commit}}")
    text = _git("log", "-1", "--format=%h %s", commit)
    if rev is None and _git("status", "--porcelain", "--untracked-files=no"):
        short, _, subject = text.partition(" ")
        text = f"{short}+ {subject}"
    return text


@contextmanager
def checkout(rev: str | None) -> Iterator[Checkout]:
    """Commit ``rev`` (None: this working tree) laid out for import, in a
    temporary folder removed on exit."""
    label = describe(rev).split(" ")[0]
    with tempfile.TemporaryDirectory(prefix="onnxps-ab-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        source = ROOT
        if rev is not None:
            source = Path(tmp) / "source"
            archive = subprocess.run(
                ["git", "archive", "--format=tar", rev],
                cwd=ROOT,
                check=True,
                capture_output=True,
            ).stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(source, filter="data")
        build_tree(tree, source)
        found = Checkout(tree, source, label)
        _check_imports(found)
        yield found


def tree_env(tree: Path) -> dict[str, str]:
    """This environment with ``tree`` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tree), env.get("PYTHONPATH", "")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _check_imports(found: Checkout) -> None:
    """Refuse a checkout whose processes would import onnxps from elsewhere."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n"
    code += "    print(importlib.import_module(m).__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code, *_OWN],
        env=tree_env(found.tree),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode:
        raise RuntimeError(f"{found.label} does not import: {proc.stderr[-2000:]}")
    source = found.source.resolve()
    for module, path in zip(_OWN, proc.stdout.split(), strict=True):
        if not Path(path).resolve().is_relative_to(source):
            raise RuntimeError(
                f"{module} of {found.label} is imported from {path}, expected a "
                f"file under {source}"
            )


class Worker:
    """``python SCRIPT ARGS`` importing onnxps from ``found``'s tree; ``call``
    sends one JSON request a line on its stdin and reads one JSON answer a line
    from its stdout. Its stderr goes to ``log``."""

    def __init__(
        self,
        found: Checkout,
        argv: Sequence[str],
        log: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """``extra_env``: set in the script's environment (e.g. malloc tunables)."""
        self.label = found.label
        self._log = log
        with open(log, "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env={**tree_env(found.tree), **(extra_env or {})},
                text=True,
            )
        self.ready = self._answer()  # the script's first line: it is set up

    def call(self, *request: Any) -> Any:
        stdin = self._pipe(self._proc.stdin)
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        return self._answer()

    def _answer(self) -> Any:
        line = self._pipe(self._proc.stdout).readline()
        if not line:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # its stdout closed, yet it runs
                self._proc.kill()
                self._proc.wait()
            tail = self._log.read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"the {self.label} worker ended (exit {self._proc.returncode}):\n{tail}"
            )
        answer = json.loads(line)
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(f"the {self.label} worker: {answer['error']}")
        return answer

    @staticmethod
    def _pipe(stream: IO[str] | None) -> IO[str]:
        assert stream is not None
        return stream

    def close(self, timeout: float = 30.0) -> None:
        """End of input ends the worker; killed if it has not within ``timeout``."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def serve_requests(handle: Any, ready: Any) -> None:
    """The worker's side: print ``ready``, then answer each JSON line on stdin
    with ``handle(*request)`` until stdin ends. Anything else the worker prints
    goes to stderr, so stdout carries answers only."""
    answers = sys.stdout
    sys.stdout = sys.stderr
    print(json.dumps(ready), file=answers, flush=True)
    for line in sys.stdin:
        try:
            answer = handle(*json.loads(line))
        except Exception as exc:  # the parent raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=answers, flush=True)
