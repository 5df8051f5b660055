"""The table of `onnxps serve` flags in docs/configuration.md, generated from
``ServerConfig``.

python scripts/config_table.py            # print the table
python scripts/config_table.py --write    # replace it in docs/configuration.md
python scripts/config_table.py --check    # exit 1 if the page is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
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
    page = PAGE.read_text()
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    fresh = page[:start] + "\n" + text + "\n" + page[end:]
    if args.check:
        if fresh != page:
            print(
                "docs/configuration.md's serve flags are out of date: run "
                "python scripts/config_table.py --write",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
