"""The hot path compiled with mypyc, or pure: what the checkout runs, and a compiled module
edited since it was built (``service/compiled.py``, ``setup.py``, ``make compiled``).

The installed wheel's hot path, and a source install without a C compiler, are in
``test_packaging.py``."""

from __future__ import annotations

import ast
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.compiled import (
    HOT_PATH,
    PURE_ENV,
    compiled_modules,
    describe,
    stale_extensions,
)
from tests.support import toolchains


def test_the_checkout_runs_the_hot_path_as_make_built_it() -> None:
    """``make test`` compiles the whole hot path where there is a C compiler; ``make
    test-pure`` (``FANOUT_HOT_PATH=pure``) runs it from the sources. Never a part of it:
    one package's compiled modules call into the others' libraries."""
    pure = os.environ.get("FANOUT_HOT_PATH") == "pure" or toolchains.missing("compiler")
    expected = [] if pure else list(HOT_PATH)
    assert compiled_modules() == expected, (
        f"hot path: {describe()}; `make compiled` builds it, `make pure` removes it"
    )
    assert describe().startswith("pure Python" if pure else "compiled with mypyc")


def _module(folder: Path, name: str, source_age_s: float, built_age_s: float | None) -> None:
    (folder / f"{name}.py").write_text("")
    os.utime(folder / f"{name}.py", (0, 1_000_000 - source_age_s))
    if built_age_s is not None:
        built = folder / (name + importlib.machinery.EXTENSION_SUFFIXES[0])
        built.write_bytes(b"")  # never imported: only its age is read
        os.utime(built, (0, 1_000_000 - built_age_s))


def test_a_module_edited_after_it_was_compiled_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "hot_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _module(package, "built_after_edit", source_age_s=60, built_age_s=30)
    _module(package, "edited_after_build", source_age_s=10, built_age_s=30)
    _module(package, "never_built", source_age_s=10, built_age_s=None)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = tuple(
        f"hot_package.{n}" for n in ("built_after_edit", "edited_after_build", "never_built")
    )
    assert stale_extensions(names) == ["hot_package.edited_after_build"]


def test_fanout_pure_runs_the_sources_of_a_compiled_checkout() -> None:
    """``FANOUT_PURE=1`` at run time: every module of the hot path from its ``.py`` file,
    whether or not the checkout is compiled; without it, as built."""
    probe = "from service import compiled; print(compiled.compiled_modules(), compiled.describe())"
    ran = {
        value: subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env={**os.environ, PURE_ENV: value},
        ).stdout
        for value in ("1", "0")
    }
    assert ran["1"].startswith("[] pure Python (FANOUT_PURE is set)"), ran
    assert ran["0"].startswith(str(compiled_modules())), ran


def test_no_function_of_the_hot_path_binds_one_name_to_two_exception_classes() -> None:
    """mypyc types a name bound by two ``except ... as name`` clauses as the first clause's
    class, and the second clause then fails with a TypeError at run time."""
    shared = []
    for name in HOT_PATH:
        path = Path(__file__).resolve().parents[1] / (name.replace(".", "/") + ".py")
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                classes: dict[str, set[str]] = {}
                for node in ast.walk(function):
                    if isinstance(node, ast.ExceptHandler) and node.name and node.type:
                        classes.setdefault(node.name, set()).add(ast.unparse(node.type))
                shared += [
                    f"{path.name}:{function.name}: {n}" for n, c in classes.items() if len(c) > 1
                ]
    assert shared == []
