"""The README's table of `onnxps serve` flags, generated from ``ServerConfig``.

python scripts/config_table.py            # print the table
python scripts/config_table.py --write    # replace it in README.md
python scripts/config_table.py --check    # exit 1 if README.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- serve-flags -->", "<!-- /serve-flags -->"


def table() -> str:
    from onnxps.server.cli import config_flags

    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for f in config_flags():
        default = "(none)" if f.default is None else f"`{f.default}`"
        rows.append(f"| `{f.flag}` | `{f.env}` | {default} | {f.meaning} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--write", action="store_true")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    text = table()
    if not (args.write or args.check):
        print(text)
        return 0
    readme = README.read_text()
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    fresh = readme[:start] + "\n" + text + "\n" + readme[end:]
    if args.check:
        if fresh != readme:
            print(
                "README.md's serve flags are out of date: run "
                "python scripts/config_table.py --write",
                file=sys.stderr,
            )
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
