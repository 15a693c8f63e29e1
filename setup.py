"""The build step pyproject.toml cannot declare: the IDL inside ``service``.

``thrift/appstats.thrift`` is the contract and its only copy in the source tree.
setuptools puts package data only from inside a package's own folder, so the
wheel gets the IDL copied in here, as ``service/appstats.thrift``, where
:mod:`service.idl` finds it with :mod:`importlib.resources`.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

IDL = Path("thrift") / "appstats.thrift"


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


setup(cmdclass={"build_py": BuildWithIdl})
