"""The documentation site builds, and its tables agree with the code they describe.

- ``mkdocs build --strict`` (mkdocs.yml): no broken link, anchor or API reference.
- Every RPC of the .proto is in docs/SECURITY.md's role table, with the roles the
  server enforces.
- Every metric a real server exports after a push is in docs/metrics.md's table.
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from onnxps.client import Adam, AsyncClient, Client
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.interceptors.security import ROLES
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "protos" / "onnxps" / "v1" / "parameter_server.proto"


def between(path: Path, marker: str) -> str:
    text = path.read_text()
    return text[text.index(f"<!-- {marker} -->") : text.index(f"<!-- /{marker} -->")]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module's tests (``mkdocs build --strict``)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (or '.[test]')")
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return site


def test_the_site_builds_strict_with_the_api_reference(site: Path) -> None:
    reference = (site / "reference" / "index.html").read_text()
    # generated from the docstrings, not retyped: the methods made at import
    for name in ("Client.push", "AsyncClient.pull", "IdsTable", "TensorBuffers"):
        assert f'id="onnxps.client.{name}"' in reference, name
    assert "Exactly once: resends carry" not in reference  # the guide's, not retyped
    pages = "".join(p.read_text() for p in site.rglob("index.html"))
    pictures = sorted((ROOT / "docs" / "img").glob("*.png"))
    assert [p.name for p in pictures] == [
        "compression.png",
        "data-channel.png",
        "kernels.png",
    ]
    for png in pictures:  # benchmarks/plots.py drew them; a page shows each
        assert (site / "img" / png.name).is_file()
        assert f"img/{png.name}" in pages, png.name


def _text(fragment: str) -> str:
    """A page's fragment as a reader sees it: no tags, one space between words."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def _rendered(reference: str, name: str) -> tuple[str, str]:
    """The reference's entry ``name`` (e.g. ``Client.push``): its signature and its
    text, each as a reader sees them."""
    start = reference.index(f'id="onnxps.client.{name}"')
    end = reference.index('<div class="doc doc-object', start)
    entry = reference[start:end]
    signature = entry[entry.index('<div class="doc-signature') : entry.index("</pre>")]
    return html.unescape(re.sub(r"<[^>]+>", "", signature)), _text(entry)


@pytest.mark.parametrize("cls", [Client, AsyncClient], ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", ["push", "pull", "create_group"])
def test_the_reference_shows_what_the_user_calls(
    site: Path, cls: type, method: str
) -> None:
    """Each entry says what the method's ``__doc__`` says (``push`` its own, not
    ``push_detailed``'s), its signature is the public one (the real return type,
    no ``Op[...]``, Literal values spelled out), formatted one parameter a line."""
    reference = (site / "reference" / "index.html").read_text()
    signature, text = _rendered(reference, f"{cls.__name__}.{method}")
    doc = inspect.getdoc(getattr(cls, method))
    assert doc is not None
    assert _text(doc.replace("``", "")) in text
    returns = {
        "push": "int | list[np.ndarray]",
        "pull": "list[np.ndarray]",
        "create_group": "GroupInfo",
    }[method]
    assert signature.rstrip().endswith(f") -> {returns}"), signature
    assert signature.startswith(f"{method}(\n    "), signature  # formatted by ruff
    if method != "create_group":
        assert 'encoding: Literal["native", "bfloat16", "float16"]' in signature
    if method == "push":
        assert "Like push, with everything the server said" not in text


def test_the_reference_has_no_internal_types(site: Path) -> None:
    reference = _text((site / "reference" / "index.html").read_text())
    assert "Op[" not in reference
    assert "ClientCore" not in reference
    assert "onnxps.client._" not in reference  # private modules' paths
    assert "OptimizerSpec = Adagrad | Momentum | Adam" in reference
    # docstrings that are not the object's: a dataclass's generated one, a
    # field's default's type's
    assert "Momentum(alpha: 'float'" not in reference
    assert "str(object='')" not in reference
    assert 'transport: Literal["auto", "unary", "stream"] = "auto"' in reference
    assert "push_background( group: str," in reference
    assert ") -> Future[PushResult]" in reference


def proto_rpcs() -> set[str]:
    return set(re.findall(r"^\s*rpc (\w+)\(", PROTO.read_text(), re.M))


def documented_roles() -> dict[str, set[str]]:
    """The role table, with 'read, plus ...' expanded."""
    roles: dict[str, set[str]] = {}
    for role, calls in re.findall(
        r"^\| (\w+)\s*\| (.+?) \|$",
        between(ROOT / "docs" / "SECURITY.md", "roles"),
        re.M,
    ):
        if role == "role" or set(calls) <= {"-", " "}:
            continue
        calls = re.sub(r"\(.*?\)", "", calls)
        names = set(re.findall(r"\b[A-Z]\w+", calls))
        for base in re.findall(r"^(\w+), plus", calls):
            names |= roles[base]
        roles[role] = names
    return roles


def test_the_role_table_names_every_rpc_as_the_server_enforces_it() -> None:
    rpcs = proto_rpcs()
    assert {"Push", "PushRows", "DataChannelHello"} <= rpcs and len(rpcs) == 29
    roles = documented_roles()
    assert sorted(roles) == ["admin", "read", "replication", "write"]
    # every RPC is named: admin may call all but Replicate, the replicas' alone
    assert roles["admin"] | roles["replication"] == rpcs
    assert roles["replication"] == {"Replicate"} and "Replicate" not in roles["admin"]
    for role, calls in roles.items():
        assert calls == set(ROLES[role]), role


def exported_metrics(text: str) -> set[str]:
    """The metrics of a scrape, by the names a query uses (counters with _total;
    a histogram's series and a counter's _created under their metric)."""
    families = list(text_string_to_metric_families(text))
    timed = {f.name for f in families if f.type in ("counter", "histogram")}
    names = set()
    for family in families:
        if family.name.endswith("_created") and family.name[:-8] in timed:
            continue  # the start time of a counter or histogram, not a metric
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return {n for n in names if n.startswith("onnxps_")}


def test_the_metrics_table_names_every_metric_a_server_exports(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
) -> None:
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="wal",
            data_dir=str(tmp_path / "data"),
            metrics_port=0,
        )
    )
    with Client(handle.address, timeout=30) as ps:
        ps.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3, np.float32)}
        )
        ps.push("g", np.ones(3, np.float32))
        with pytest.raises(ValueError):
            ps.push("g", np.ones(4, np.float32))  # a refused push counts too
        ps.pull("g")
        ps.apply(Adam(), 0.1, 0, *[np.zeros(3, np.float32)] * 4)
    url = f"http://127.0.0.1:{handle.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        exported = exported_metrics(reply.read().decode())
    documented = set(
        re.findall(
            r"^\| `(onnxps_\w+)`",
            between(ROOT / "docs" / "metrics.md", "metrics"),
            re.M,
        )
    )
    assert {"onnxps_rpcs_total", "onnxps_waiting_calls"} <= exported
    assert sorted(exported - documented) == []
    assert sorted(documented - exported) == []


def test_the_readme_is_a_front_door_to_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in readme
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    pages = {"index.md", "protocol.md", "troubleshooting.md", "reference.md"}
    assert pages <= {Path(link).name for link in links}
    for link in links:
        assert (ROOT / link).is_file(), link


def test_the_home_page_quickstart_is_the_readmes() -> None:
    """tests/client/test_cli.py runs the README's; the site's home page shows the
    same."""

    def quickstart(path: Path) -> str:
        found = re.search(r"```python\n(.*?)```", path.read_text(), re.S)
        assert found is not None, path
        return found.group(1)

    assert quickstart(ROOT / "docs" / "index.md") == quickstart(ROOT / "README.md")
