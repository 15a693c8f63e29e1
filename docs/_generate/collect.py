"""What the manual's reference pages are made from, read from the code's own declarations.

Run as a script (``python docs/_generate/collect.py``), it prints one JSON object: the
settings tables, the command line, the metrics, the log fields, the IDL and the public
exception types. The MkDocs hook beside it (``hooks.py``) runs it once per build, in a
process of its own, so that the build never imports the server (which patches the
standard library with gevent's cooperative versions).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "lookups", "tracing")


def import_everything() -> list[Any]:
    """Every module of the three packages (the sample backends and ``__main__`` aside)."""
    modules = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if ".samples" in info.name or info.name.endswith("__main__"):
                continue
            modules.append(importlib.import_module(info.name))
    return modules


def settings_tables() -> dict[str, str]:
    from service.cli.settings_table import tables

    return tables()


def command_line() -> dict[str, Any]:
    """Each command of ``fanout``: its help, usage and options, as argparse declares them."""
    from service.cli.main import _parser

    parser = _parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    commands = [
        {
            "name": "fanout",
            "help": parser.description,
            "usage": _usage(parser),
            "options": _options(parser),
        }
    ]
    for name, sub in subparsers.choices.items():
        commands.append(
            {
                "name": f"fanout {name}",
                "help": helps.get(name, ""),
                "usage": _usage(sub),
                "options": _options(sub),
            }
        )
    return {"commands": commands}


def _usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().split())[len("usage: ") :]


def _options(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    options = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        options.append(
            {
                "flags": list(action.option_strings) or [action.dest],
                "metavar": action.metavar if isinstance(action.metavar, str) else None,
                "choices": [str(c) for c in action.choices] if action.choices else None,
                "help": action.help or "",
            }
        )
    return options


def metrics() -> list[dict[str, str]]:
    """Every instrument the modules created on OpenTelemetry's (proxy) meters at import,
    and the series the master of a worker group writes itself."""
    from opentelemetry.exporter.prometheus._mapping import map_unit, sanitize_full_name
    from opentelemetry.metrics import _internal as otel_metrics

    from service.workers.group import GROUP_SERIES

    found = []
    for meter in otel_metrics._PROXY_METER_PROVIDER._meters:
        if not meter._name.startswith("fanout"):  # an instrumentation's, if one is on
            continue
        for instrument in meter._instruments:
            kind = type(instrument).__name__.replace("_Proxy", "")
            unit = map_unit(instrument._unit or "")
            name = sanitize_full_name(instrument._name)
            if unit and not name.endswith("_" + unit):
                name += "_" + unit
            if "Counter" in kind and "UpDown" not in kind:
                name += "_total"
            found.append(
                {
                    "otel": instrument._name,
                    "prometheus": name,
                    "kind": kind,
                    "unit": instrument._unit or "",
                    "help": instrument._description,
                    "meter": meter._name,
                }
            )
    for name, help_text, kind in GROUP_SERIES:
        found.append(
            {
                "otel": "",
                "prometheus": name,
                "kind": kind,
                "unit": "",
                "help": help_text,
                "meter": "worker group (master)",
            }
        )
    return found


def log_fields() -> list[str]:
    from service.operations.logs import JSON_FIELDS

    return list(JSON_FIELDS)


def idl() -> dict[str, Any]:
    """The IDL's text and, per kind, its declarations, as thriftpy2 loads them."""
    from service.idl import appstats, idl_file

    text = idl_file().read_text()
    service = appstats.AppStats
    methods = []
    for name in service.thrift_services:
        args = getattr(service, f"{name}_args")
        result = getattr(service, f"{name}_result")
        methods.append(
            {
                "name": name,
                "args": _fields(args),
                "returns": _type_name(result.thrift_spec.get(0))
                if 0 in result.thrift_spec
                else "void",
                "throws": [f["name"] + ": " + f["type"] for f in _fields(result) if f["id"] != 0],
            }
        )
    kinds: dict[str, list[Any]] = {"struct": [], "union": [], "exception": [], "enum": []}
    for name, value in sorted(vars(appstats).items()):
        if not inspect.isclass(value) or name.startswith("_") or value is service:
            continue
        if hasattr(value, "_VALUES_TO_NAMES"):
            kinds["enum"].append(
                {
                    "name": name,
                    "values": [f"{v} = {k}" for k, v in sorted(value._VALUES_TO_NAMES.items())],
                }
            )
        elif hasattr(value, "thrift_spec"):
            kind = (
                "exception"
                if issubclass(value, Exception)
                else "union"
                if f"union {name}" in text
                else "struct"
            )
            kinds[kind].append({"name": name, "fields": _fields(value)})
    return {"text": text, "methods": methods, **kinds}


def _fields(cls: Any) -> list[dict[str, Any]]:
    return [
        {"id": fid, "name": spec[1], "type": _type_name(spec)}
        for fid, spec in sorted(cls.thrift_spec.items())
    ]


_TTYPES = {2: "bool", 3: "byte", 4: "double", 6: "i16", 8: "i32", 10: "i64", 11: "string"}


def _type_name(spec: Any) -> str:
    """A field's ``(ttype, name, [inner,] required)`` as thriftpy2 keeps it, as in the IDL."""
    return _inner_name((spec[0], spec[2]) if len(spec) == 4 else spec[0])


def _inner_name(inner: Any) -> str:
    """A contained type: a bare ttype, or ``(ttype, class or contained type(s))``."""
    if isinstance(inner, int):
        return _TTYPES.get(inner, str(inner))
    ttype, of = inner
    if ttype == 15:
        return f"list<{_inner_name(of)}>"
    if ttype == 14:
        return f"set<{_inner_name(of)}>"
    if ttype == 13:
        return f"map<{_inner_name(of[0])}, {_inner_name(of[1])}>"
    return getattr(of, "__name__", _TTYPES.get(ttype, str(ttype)))


def exceptions(modules: list[Any]) -> list[dict[str, Any]]:
    """Every public exception class (named in a module's ``__all__``) of the three packages."""
    found = {}
    for module in modules:
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name, None)
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                doc = inspect.getdoc(value) or ""
                found[f"{module.__name__}.{name}"] = {
                    "name": name,
                    "module": module.__name__,
                    "bases": [b.__name__ for b in value.__bases__],
                    "retryable": getattr(value, "retryable", None),
                    "doc": doc.split("\n\n")[0].replace("\n", " "),
                }
    return sorted(found.values(), key=lambda e: (e["module"], e["name"]))


def collect() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    modules = import_everything()
    return {
        "settings": settings_tables(),
        "cli": command_line(),
        "metrics": metrics(),
        "log_fields": log_fields(),
        "idl": idl(),
        "exceptions": exceptions(modules),
    }


if __name__ == "__main__":
    from gevent import monkey

    monkey.patch_all()
    json.dump(collect(), sys.stdout, indent=1, default=str)
