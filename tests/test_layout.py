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
    return [
        f"{path} imports {name}"
        for path, names in imported_modules(package).items()
        for name in sorted(names)
        if name.split(".")[0] in forbidden
        or name in forbidden
        or any(name.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize("package", ["lookups", "tracing"])
def test_lookups_and_tracing_import_nothing_from_service(package: str) -> None:
    assert imported_modules(package), f"no modules found under {package}/"
    assert offending(package, ("service",)) == []


def test_the_engine_knows_nothing_of_thrift_mongo_http_or_the_server() -> None:
    forbidden = (
        "thriftpy2",
        "thrift",
        "pymongo",
        "requests",
        "urllib3",
        "service.idl",
        "service.rpc.handler",
        "service.listener.server",
        "service.wire",
        "service.settings.config",
    )
    assert offending("service/engine", forbidden) == []


def test_lookups_import_no_thrift_types() -> None:
    assert offending("lookups", ("thriftpy2", "thrift")) == []


def test_the_wire_knows_nothing_of_the_handler_or_the_engine() -> None:
    """Nothing of the lookups either, but the clock every part reads (lookups/clock.py)."""
    forbidden = ("service.rpc.handler", "service.engine", "lookups")
    found = offending("service/wire", forbidden)
    assert [line for line in found if not line.endswith(" imports lookups.clock")] == []


#: What ``import service.client`` may load of ours: the client, the IDL, the deadline and
#: retry budget it shares with the server, its TLS context, and the span helpers.
CLIENT_MODULES = {
    "service",
    "service.client",
    "service.client.connections",
    "service.client.hedging",
    "service.client.instances",
    "service.idl",
    "service.errors",
    "service.wire",
    "service.wire.tls",
    "service.wire.formats",
    "lookups.clock",
    "lookups.deadline",
    "lookups.flow",
    "lookups",
    "lookups.errors",
    "lookups.resilience",
    "lookups.resilience.guard",
    "lookups.resilience.breaker",
    "tracing",
    "tracing.exceptions",
    "tracing.context",
    "tracing.spans",
}


def test_the_web_tier_client_stands_alone() -> None:
    """A web tier that imports the client loads none of the server: no engine, no server
    configuration, no backends' clients, and no server metrics that would read 0 there."""
    import subprocess
    import sys

    probe = (
        "import sys, service.client; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('service', 'lookups', 'tracing'))); "
        "print(sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
        "('pymongo', 'requests', 'bson')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    ours, libraries = (ast.literal_eval(line) for line in result.stdout.splitlines())
    assert set(ours) == CLIENT_MODULES
    assert libraries == []


def test_every_module_has_a_row_in_the_tests_index() -> None:
    """tests/README.md says where each module's tests are; a new module needs its row."""
    index = (ROOT / "tests" / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("| `")]
    listed: set[str] = set()
    for row in rows:
        cell = row.split("|")[1]
        names = [name.strip("` ") for name in cell.split(",")]
        folder = names[0].rsplit("/", 1)[0] if "/" in names[0] else ""
        listed.update(name if "/" in name else f"{folder}/{name}" for name in names)
    missing = []
    for path in sorted(
        p
        for package in ("service", "lookups", "tracing")
        for p in (ROOT / package).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    ):
        relative = str(path.relative_to(ROOT))
        if relative not in listed and f"{relative.rsplit('/', 1)[0]}/*.py" not in listed:
            missing.append(relative)
    assert missing == []
    named = {word.strip("`,") for row in rows for word in row.split("|")[2].split()}
    assert {name for name in named if name.startswith("test_")} <= {
        p.name for p in (ROOT / "tests").glob("test_*.py")
    }


def _named(node: ast.expr, names: tuple[str, ...]) -> bool:
    return (isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr in names
    )


def reaches_into(package: str, owner: str, names: tuple[str, ...]) -> list[str]:
    """``X.<name>.part.field`` anywhere under ``package`` but in ``owner``: a part of the
    object held as one of ``names`` worked from outside it. Its verbs and read-only
    properties (``X.admission.admit(...)``, ``X.admission.limit``) are one level."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative == owner:
            continue
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and _named(node.value.value, names)
            ):
                found.append(f"{relative}:{node.lineno} .{node.value.attr}.{node.attr}")
    return found


def test_admission_alone_works_its_parts() -> None:
    """Admission owns the limit, its line, the callers' shares, retry-after and the CPU
    rule: the rest of the service reaches it through its verbs, never through its parts."""
    owner = "service/overload/admission.py"
    assert reaches_into("service", owner, ("admission", "_admission")) == []


def test_the_fair_share_switch_is_read_in_one_place() -> None:
    """``admission.fair_share`` is read where admission is made; its parts are told."""
    reads = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            if isinstance(node, ast.Attribute) and node.attr == "fair_share":
                reads.append(relative)
    assert reads == ["service/overload/admission.py"]
