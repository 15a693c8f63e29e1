"""MkDocs hook: the built site searches when opened from disk, with nothing fetched from the
network.

A browser runs no web worker for a ``file://`` page, and reads no file beside it with
``fetch``. Material for MkDocs' search needs both; its ``offline`` plugin inlines the
search index as ``search/search_index.js`` and adds a shim that runs the worker in an
iframe, the shim fetched from a CDN. This hook does the same with a copy of the shim
shipped in the site (``vendor/iframe-worker-shim.js``, MIT), so a reader without a
network searches too. Nothing here is bound to the theme by name: with a theme that
has no such search (no ``search_index.json`` built), it adds a file no page loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

SHIM = Path(__file__).resolve().parent / "vendor" / "iframe-worker-shim.js"
SHIM_URI = "assets/javascripts/iframe-worker-shim.js"


def on_config(config: Any) -> Any:
    config.extra["polyfills"] = [SHIM_URI]
    return config


def on_files(files: Any, config: Any) -> Any:
    files.append(File.generated(config, SHIM_URI, content=SHIM.read_text(encoding="utf-8")))
    return files


def on_post_build(config: Any) -> None:
    search = Path(config.site_dir) / "search"
    index = search / "search_index.json"
    if index.is_file():  # the theme's search reads this script from a file:// page
        script = "var __index = " + index.read_text(encoding="utf-8")
        (search / "search_index.js").write_text(script, encoding="utf-8")
