"""The build steps pyproject.toml cannot declare: the IDL inside ``service``, and the
hot path compiled with mypyc where a C compiler is present.

``thrift/appstats.thrift`` is the contract and its only copy in the source tree.
setuptools puts package data only from inside a package's own folder, so the
wheel gets the IDL copied in here, as ``service/appstats.thrift``, where
:mod:`service.idl` finds it with :mod:`importlib.resources`.

The modules of ``service.compiled.HOT_PATH`` (read from that file, not imported) are
compiled with mypyc into C extensions beside their sources. Where that cannot be done
(no mypyc, no C compiler, ``FANOUT_PURE=1``, an editable install) the build says so and
goes on in pure Python: same behaviour, more CPU per call. ``fanout serve`` logs which.
"""

import os
import runpy
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CCompilerError, ExecError, PlatformError

IDL = Path("thrift") / "appstats.thrift"
COMPILED = runpy.run_path(str(Path("service") / "compiled.py"))  # not imported: see there
HOT_PATH = COMPILED["HOT_PATH"]
#: The type-check mypyc runs to compile. Only the compiled modules are read; what they
#: import from elsewhere (the libraries, our other modules) is typed Any, so the build is
#: the same whether or not the dependencies are installed beside it (an isolated build
#: has none). `make lint` checks every module strictly, with the dependencies' types.
MYPYC_FLAGS = ["--config-file=", "--ignore-missing-imports", "--follow-imports=skip"]


class BuildWithIdl(build_py):
    """``build_py`` that also copies the IDL into the built ``service`` package."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads thrift/ in place
            target = Path(self.build_lib) / "service" / IDL.name
            self.copy_file(str(IDL), str(target), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if self.editable_mode else [str(Path(self.build_lib) / "service" / IDL.name)]
        return [*super().get_outputs(include_bytecode), *extra]


class BuildExtOrPure(build_ext):
    """``build_ext`` that leaves the hot path in pure Python when it cannot compile it."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError) as exc:  # no compiler, or it failed
            _pure(f"compiling failed ({type(exc).__name__}: {exc})")
            # All or nothing: one package's compiled modules call into the others' libraries.
            for path in self.get_outputs():
                Path(path).unlink(missing_ok=True)
            self.extensions = []


def _pure(why: str) -> None:
    if os.environ.get("FANOUT_REQUIRE_COMPILED"):  # `make compiled`: no quiet fallback
        sys.exit(f"fanout: the hot path could not be compiled: {why}")
    print(f"fanout: the hot path stays pure Python: {why}", file=sys.stderr)


def _compiled_extensions() -> list[object]:
    if COMPILED["pure_requested"]():
        print(
            f"fanout: the hot path stays pure Python: {COMPILED['PURE_ENV']} is set",
            file=sys.stderr,
        )
        return []
    if any(arg.startswith(("develop", "editable")) for arg in sys.argv[1:]):
        return []  # an editable install runs the sources as they are edited
    try:
        from mypyc.build import mypycify
    except ImportError:
        _pure("mypyc is not installed")
        return []
    sources = [str(Path(*name.split(".")).with_suffix(".py")) for name in HOT_PATH]
    # One shared library per package (``lookups/hot_path__mypyc...so``), so that each
    # package's compiled modules load only what lives in that package.
    groups = [
        ([path for path in sources if path.startswith(package + os.sep)], f"{package}.hot_path")
        for package in sorted({name.split(".")[0] for name in HOT_PATH})
    ]
    try:
        return list(mypycify([*MYPYC_FLAGS, *sources], opt_level="3", separate=groups))
    except SystemExit as exc:  # how mypy reports a type error
        _pure(f"mypyc could not translate it ({type(exc).__name__}: {exc})")
        return []


setup(
    cmdclass={"build_py": BuildWithIdl, "build_ext": BuildExtOrPure},
    ext_modules=_compiled_extensions(),
)
