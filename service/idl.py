"""The Thrift contract, loaded once from ``thrift/appstats.thrift``."""

from __future__ import annotations

from pathlib import Path

import thriftpy2

__all__ = ["IDL_PATH", "appstats"]

IDL_PATH = Path(__file__).resolve().parent.parent / "thrift" / "appstats.thrift"

# module_name must end in "_thrift" for thriftpy2's pickling support; loading once
# keeps the generated classes identical everywhere (isinstance checks depend on it).
appstats = thriftpy2.load(str(IDL_PATH), module_name="appstats_thrift")
