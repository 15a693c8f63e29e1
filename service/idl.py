"""The Thrift contract, loaded once.

An installed Fanout reads the IDL that its wheel carries as package data
(``appstats.thrift`` in the ``service`` package, copied there from ``thrift/`` by
``setup.py``);
a source checkout reads ``thrift/appstats.thrift``, the only copy in the tree.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import thriftpy2

__all__ = ["IDL_NAME", "appstats", "idl_file"]

IDL_NAME = "appstats.thrift"


def idl_file() -> Traversable:
    """Where the IDL is: the installed package's data, else the checkout's ``thrift/``."""
    packaged = resources.files(__package__) / IDL_NAME
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "thrift" / IDL_NAME


def _load() -> Any:
    # Any: thriftpy2 makes the IDL's classes at run time, so no checker can see them.
    with resources.as_file(idl_file()) as path:
        # module_name must end in "_thrift" for thriftpy2's pickling support; loading
        # once keeps the generated classes identical everywhere (isinstance checks).
        return thriftpy2.load(str(path), module_name="appstats_thrift")


appstats = _load()
