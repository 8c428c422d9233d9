"""`harnessrl config show SERVICE`: the effective configuration, secrets masked;
`harnessrl config reference`: every setting of every service, as Markdown."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from harnessrl import registry
from harnessrl.command import add_config_option, load

SERVICES = {spec.name: spec.config for spec in registry.SERVICES}
"""Service name -> "module:ConfigClass" (imported only when shown)."""


def register(commands: Any) -> None:
    parser = commands.add_parser("config", help="inspect configuration")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    show = sub.add_parser(
        "show",
        help="print a service's effective configuration",
        description="Print the configuration SERVICE would run with (defaults, then the YAML "
        "file, then HARNESSRL_* environment variables), as JSON, with secrets masked.",
    )
    show.add_argument(
        "service",
        choices=sorted(SERVICES),
        metavar="SERVICE",
        help=f"one of: {', '.join(sorted(SERVICES))}",
    )
    show.add_argument("--describe", action="store_true", help="also print what each field means")
    add_config_option(show)
    show.set_defaults(run=run_show)
    reference = sub.add_parser(
        "reference",
        help="print the configuration reference (docs/configuration.md) as Markdown",
        description="Print every section and field of every service's settings (type, "
        "default, bounds, environment variable, docstring) as Markdown: "
        "`harnessrl config reference > docs/configuration.md` regenerates that page.",
    )
    reference.set_defaults(run=run_reference)
    parser.set_defaults(run=lambda _: parser.print_help() or 2)


def run_show(args: argparse.Namespace) -> int:
    import orjson

    from harnessrl.config import masked

    module, _, name = SERVICES[args.service].partition(":")
    cls = getattr(importlib.import_module(module), name)
    config = load(cls, args)
    sys.stdout.buffer.write(orjson.dumps(masked(config), option=orjson.OPT_INDENT_2) + b"\n")
    if args.describe:
        for path, text in _descriptions(cls):
            print(f"{path}: {text}")
    return 0


def run_reference(args: argparse.Namespace) -> int:
    from harnessrl.apps.cli.config_reference import render

    sys.stdout.write(render())
    return 0


def _descriptions(model: Any, prefix: str = "") -> list[tuple[str, str]]:
    from pydantic import BaseModel

    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _descriptions(annotation, f"{path}.")
        elif field.description:
            rows.append((path, " ".join(field.description.split())))
    return rows
