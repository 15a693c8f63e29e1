"""References stay true: what the manual, the IDL, the docstrings and the comments name
exists, and the package map names every module.

A path in backticks (``service/overload/gate.py``, ``docs/how-to/tls.md``), a dotted name
of ours (``service.overload.gate.CallGate``) and a section of the README named in quotes
must each be found in the tree as it is; a reader sent to one that moved or went is lost.
A settings key (``tracing.sample_ratio``) and a file name (``tracing.py``) are not
dotted names; what a run writes (``bench/results/``) is not in the tree.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "lookups", "tracing")
#: Where references are read: pages, the contract, and every source file of ours.
READ = ("docs", "thrift", "deploy", "service", "lookups", "tracing", "tests", "bench")
_TOPS = "|".join((*PACKAGES, "tests", "bench", "docs", "deploy", "thrift", ".ci"))
_PATH = re.compile(r"`{1,2}((?:" + _TOPS + r")/[\w./-]*)`{1,2}")
_DOTTED = re.compile(r"`{1,2}(?::\w+:`?)?((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)`{1,2}")
_README = re.compile(r"README(?:'s|\.md's)\s+(?:\"([^\"]+)\"|'([^']+)'|section|tables?)")
#: Written by a run, not kept in the tree.
_RUN_OUTPUT = ("bench/results/",)
#: Dotted words that are no module of ours: a resource attribute, a manifest.
_NOT_NAMES = {"service.name", "service.yaml"}


def _texts() -> Iterator[tuple[str, str]]:
    for folder in READ:
        for path in sorted((ROOT / folder).rglob("*")):
            wanted = path.suffix in (".md", ".py", ".thrift", ".yaml", ".toml")
            if wanted and path.is_file() and "__pycache__" not in path.parts:
                yield str(path.relative_to(ROOT)), path.read_text(errors="replace")
    yield "README.md", (ROOT / "README.md").read_text()


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def test_every_path_named_in_backticks_exists() -> None:
    missing = []
    for name, text in _texts():
        for found in _PATH.finditer(text):
            target = found.group(1).rstrip(".,:;")
            if any(mark in target for mark in ("*", "<", "{", "...", "…")):
                continue  # a pattern or a placeholder, not a path
            if target.startswith(_RUN_OUTPUT):
                continue
            if not (ROOT / target).exists():
                missing.append(f"{name}:{_line(text, found.start())}: {target}")
    assert missing == [], "\n".join(missing)


def _defined(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _resolves(dotted: str) -> bool:
    """The longest prefix that is a module of ours, then at most two names, the first
    defined (or imported) there."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        return not rest or (len(rest) <= 2 and rest[0] in _defined(module))
    return False


def _settings_keys() -> set[str]:
    """``section.key`` of every key the sections of ours declare."""
    from service.settings.config import load_settings

    keys = set()
    for section, value in vars(load_settings(env={})).items():
        if dataclasses.is_dataclass(value):
            keys |= {f"{section}.{field.name}" for field in dataclasses.fields(value)}
    return keys


def test_every_dotted_name_of_ours_resolves() -> None:
    missing, keys = [], _settings_keys()
    for name, text in _texts():
        for found in _DOTTED.finditer(text):
            dotted = found.group(1)
            if dotted in keys or dotted in _NOT_NAMES or dotted.endswith((".py", ".md")):
                continue
            if not _resolves(dotted):
                missing.append(f"{name}:{_line(text, found.start())}: {found.group(1)}")
    assert missing == [], "\n".join(missing)


def _readme_sections() -> set[str]:
    text = (ROOT / "README.md").read_text()
    return {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}


def test_a_readme_section_named_anywhere_is_in_the_readme() -> None:
    sections, wrong = _readme_sections(), []
    for name, text in _texts():
        for found in _README.finditer(text):
            if (found.group(1) or found.group(2)) not in sections:
                wrong.append(f"{name}:{_line(text, found.start())}: {found.group(0)}")
    assert wrong == [], "\n".join(wrong)


def _package_map() -> dict[str, set[str]]:
    """The package map of docs/explanation/architecture.md: the words said of each folder
    (``service/rpc/``) or file (``lookups/clock.py``) it has an entry for."""
    page = (ROOT / "docs" / "explanation" / "architecture.md").read_text()
    block = page.split("## The package map", 1)[1].split("```")[1]
    entries: dict[str, set[str]] = {}
    top = current = ""
    for line in block.splitlines():
        indent, token = len(line) - len(line.lstrip()), line.strip().split(" ")[0]
        if line and indent == 0:  # a top folder (service/) or file (lookups/clock.py)
            top = token if token.endswith("/") else ""
            current = token
        elif indent == 2:  # a folder in it (rpc/), or files directly in it (app.py)
            current = top + token if token.endswith("/") else top
        entries.setdefault(current, set()).update(re.findall(r"\w+", line))
    return entries


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_map_names_every_module_in_its_folder(package: str) -> None:
    entries, unnamed = _package_map(), []
    for module in sorted((ROOT / package).rglob("*.py")):
        if module.name.startswith("__") or "__pycache__" in module.parts:
            continue
        relative = module.relative_to(ROOT)
        own = entries.get(str(relative), set())
        folder = entries.get(f"{relative.parent}/", set())
        if module.stem not in own | folder:
            unnamed.append(str(relative))
    assert unnamed == [], "not in docs/explanation/architecture.md's package map:\n" + "\n".join(
        unnamed
    )
