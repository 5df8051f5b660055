"""The benchmark figures as pictures: docs/img/*.png, drawn from the pages' tables.

The figures live in one place, the tables of docs/benchmarks.md and
docs/transports.md (each beside the command that measured it); this script reads
those tables and draws them, so a picture cannot say something its table does not.
After re-running a benchmark, update its table, then run this again and commit the
PNGs. Needs matplotlib (`pip install -e '.[docs]'`).

    python benchmarks/plots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def table_after(
    page: Path, header_start: str, heading: str | None = None
) -> list[list[str]]:
    """The rows (cells, without the header and separator) of the first table of
    ``page`` whose header starts with ``header_start``, after ``heading`` if given."""
    text = page.read_text()
    if heading is not None:
        text = text[text.index(heading) :]
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def number(cell: str) -> float | None:
    """The first figure of a cell (``**32.3** (30.6-32.6)`` -> 32.3); None for -."""
    m = re.search(r"\d[\d,]*(?:\.\d+)?", cell.replace("**", ""))
    return None if m is None else float(m.group(0).replace(",", ""))


def spread(cell: str) -> tuple[float, float] | None:
    """The (min, max) of a cell's ``(a-b)``, if it has one."""
    m = re.search(r"\((\d[\d,]*(?:\.\d+)?)-(\d[\d,]*(?:\.\d+)?)\)", cell)
    if m is None:
        return None
    return float(m.group(1).replace(",", "")), float(m.group(2).replace(",", ""))


def plain(label: str) -> str:
    return re.sub(r"[*`]", "", label)


def grouped_bars(
    ax: object,
    groups: Sequence[str],
    series: dict[str, list[float | None]],
    errors: dict[str, list[tuple[float, float] | None]] | None = None,
) -> None:
    import numpy as np

    width = 0.8 / len(series)
    x = np.arange(len(groups))
    for k, (name, values) in enumerate(series.items()):
        heights = [np.nan if v is None else v for v in values]
        yerr = None
        if errors is not None:
            lo = [
                0.0 if e is None or v is None else v - e[0]
                for v, e in zip(values, errors[name], strict=True)
            ]
            hi = [
                0.0 if e is None or v is None else e[1] - v
                for v, e in zip(values, errors[name], strict=True)
            ]
            yerr = [lo, hi]
        ax.bar(  # type: ignore[attr-defined]
            x + (k - (len(series) - 1) / 2) * width,
            heights,
            width,
            label=name,
            yerr=yerr,
            capsize=2,
        )
    ax.set_xticks(x, groups)  # type: ignore[attr-defined]
    ax.legend(fontsize=8)  # type: ignore[attr-defined]
    ax.grid(axis="y", alpha=0.3)  # type: ignore[attr-defined]


def data_channel(out: Path) -> Path:
    """64 MiB push, pull and push returning X: onnxps's transports and peers."""
    import matplotlib.pyplot as plt

    rows = table_after(
        DOCS / "benchmarks.md", "| system | push ms", "## Beyond gRPC: the data channel"
    )
    calls = ["push", "pull", "push returning X"]
    series = {plain(r[0]): [number(c) for c in r[1:4]] for r in rows}
    errors = {plain(r[0]): [spread(c) for c in r[1:4]] for r in rows}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    grouped_bars(ax, calls, series, errors)
    ax.set_ylabel("ms, median (min-max) of 5 rounds")
    ax.set_title("One 64 MiB float32 Adam call over loopback (lower is better)")
    return save(fig, out / "data-channel.png")


def kernels(out: Path) -> Path:
    """ns per element of one optimizer step, by path."""
    import matplotlib.pyplot as plt

    rows = table_after(DOCS / "benchmarks.md", "| operator | elements |")
    text = (DOCS / "benchmarks.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| operator"))
    paths = [plain(c.strip()) for c in header.strip("|").split("|")[2:]]
    groups = [f"{r[0]} {r[1]}" for r in rows]
    series = {p: [number(r[2 + k]) for r in rows] for k, p in enumerate(paths)}
    fig, ax = plt.subplots(figsize=(10, 4.2))
    grouped_bars(ax, groups, series)
    ax.set_yscale("log")
    ax.set_ylabel("ns per element (log scale)")
    ax.set_title("One optimizer step, float32, median of 9 rounds (lower is better)")
    return save(fig, out / "kernels.png")


def compression(out: Path) -> Path:
    """64 MiB calls in 2-byte encodings, on gRPC streams and on the data channel."""
    import matplotlib.pyplot as plt

    rows = table_after(DOCS / "transports.md", "| 64 MiB call | gRPC streams")
    calls = [plain(r[0]) for r in rows]
    series = {
        "gRPC streams": [number(r[1]) for r in rows],
        "data channel": [number(r[3]) for r in rows],
    }
    fig, ax = plt.subplots(figsize=(8, 4.2))
    grouped_bars(ax, calls, series)
    ax.set_ylabel("ms, median of 7 rounds")
    ax.set_title("64 MiB float32 calls, native and encoded (lower is better)")
    return save(fig, out / "compression.png")


def save(fig: object, path: Path) -> Path:
    fig.tight_layout()  # type: ignore[attr-defined]
    # no timestamps in the file, so an unchanged figure is an unchanged PNG
    fig.savefig(path, dpi=100, metadata={"Software": None})  # type: ignore[attr-defined]
    import matplotlib.pyplot as plt

    plt.close(fig)  # type: ignore[arg-type]
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DOCS / "img")
    args = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("plots.py needs matplotlib: pip install -e '.[docs]'", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (data_channel, kernels, compression):
        print(draw(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
