"""``onnxps export`` and ``onnxps import``: groups to and from one .npz file."""

from __future__ import annotations

import argparse
import os

from onnxps.client import Client
from onnxps.client._cluster import parse_target

__all__ = ["add_export_arguments", "add_import_arguments", "run"]

_TOKEN = "bearer token (ONNXPS_TOKEN)"
_ADDRESS = (
    "host:port of the server, or of every shard of a cluster in shard order, "
    "comma-separated (a cluster exports to one file and imports into any shard count)"
)


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help=_ADDRESS)
    p.add_argument("file", help="the .npz file to write")
    p.add_argument("--prefix", default="", help="only groups whose name starts so")
    p.add_argument("--token", default=os.environ.get("ONNXPS_TOKEN"), help=_TOKEN)


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help=_ADDRESS)
    p.add_argument("file", help="a file written by onnxps export")
    p.add_argument("--token", default=os.environ.get("ONNXPS_TOKEN"), help=_TOKEN)


def run(args: argparse.Namespace) -> int:
    with Client(parse_target(args.address), token=args.token) as client:
        if args.command == "export":
            names = client.export(args.file, prefix=args.prefix)
            print(f"exported {len(names)} groups to {args.file}")
        else:
            names = client.import_(args.file)
            print(f"imported {len(names)} groups from {args.file}")
    return 0
