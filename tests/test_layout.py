"""The package rules the architecture states: imports run one way, the engine knows no wire."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module each file under ``package`` imports, by file (relative imports resolved)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module if node.level == 0 else f".{node.module}")
        found[str(path.relative_to(ROOT))] = names
    return found


def offending(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path} imports {name}" for path, names in imported_modules(package).items()
            for name in sorted(names) if name.split(".")[0] in forbidden or name in forbidden
            or any(name.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("package", ["lookups", "tracing"])
def test_lookups_and_tracing_import_nothing_from_service(package: str) -> None:
    assert imported_modules(package), f"no modules found under {package}/"
    assert offending(package, ("service",)) == []


def test_the_engine_knows_nothing_of_thrift_mongo_http_or_the_server() -> None:
    forbidden = ("thriftpy2", "thrift", "pymongo", "requests", "urllib3", "service.idl",
                 "service.handler", "service.server", "service.wire", "service.config")
    assert offending("service/engine", forbidden) == []


def test_lookups_import_no_thrift_types() -> None:
    assert offending("lookups", ("thriftpy2", "thrift")) == []


def test_the_wire_knows_nothing_of_the_handler_or_the_engine() -> None:
    forbidden = ("service.handler", "service.engine", "lookups")
    assert offending("service/wire", forbidden) == []
