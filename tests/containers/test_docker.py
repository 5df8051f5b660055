"""The Dockerfile: the server image runs as a non-root user and carries no
scikit-learn; the demo image (target demo) adds it, also non-root."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _stages() -> dict[str, list[str]]:
    """Each stage's instructions (continuation lines joined, comments dropped)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = stages.setdefault(m.group(1), [])
        current.append(line)
    return stages


def _user(stage: list[str]) -> str | None:
    users = [line.split()[1] for line in stage if line.startswith("USER ")]
    return users[-1] if users else None


def test_images_run_as_a_non_root_user() -> None:
    stages = _stages()
    assert list(stages)[-1] == "server"  # the default target
    for name in ("server", "demo"):
        assert _user(stages[name]) == "onnxps", name
        assert stages[name][0].startswith("FROM base AS "), name
    assert any("useradd" in line and "onnxps" in line for line in stages["base"])
    assert any("chown onnxps:onnxps /data" in line for line in stages["base"])


def test_scikit_learn_only_in_the_demo_image() -> None:
    stages = _stages()
    demo = [line for name, s in stages.items() for line in s if "[demo]" in line]
    assert demo == ["RUN pip install '.[demo]'"]
    assert demo[0] in stages["demo"]
    # both images serve and reach replicated shards (etcd's client)
    assert "RUN pip install '.[replication]'" in stages["base"]


def _copied_top_folders() -> set[str]:
    """Top-level names of the build context that the Dockerfile's COPYs take."""
    copied: set[str] = set()
    for stage in _stages().values():
        for line in stage:
            if not line.startswith("COPY "):
                continue
            sources = line.split()[1:-1]
            if sources == ["."]:
                ignored = {
                    entry.strip().rstrip("/")
                    for entry in (ROOT / ".dockerignore").read_text().splitlines()
                    if entry.strip() and not entry.startswith("#")
                }
                copied |= {p.name for p in ROOT.iterdir()} - ignored
            else:
                copied |= {src.strip("./").split("/")[0] for src in sources}
    return copied


def test_the_image_gets_every_package_directory_pyproject_maps() -> None:
    # `pip install .` in the image fails on a mapped folder the context lacks (it
    # did: torch_integration, for onnxps.torch). tests/containers/test_containers.py
    # builds it.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    needed = {path.split("/")[0] for path in mapping.values()}
    needed |= {"pyproject.toml", "README.md"}
    assert needed - _copied_top_folders() == set()
