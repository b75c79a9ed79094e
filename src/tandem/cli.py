"""The `tandem` command: one sub-command per subsystem.

Each subsystem module exposes `add_parser(subparsers)`, which registers its sub-command and sets
`func` on the parsed namespace. Those modules import nothing heavy at import time, so `tandem
--help` stays fast; the heavy imports happen inside `func`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "tandem.engine.cli",  # generate
    "tandem.server.cli",  # worker
    "tandem.router.cli",  # router
    "tandem.launcher.cli",  # serve
    "tandem.bench.cli",  # bench
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
