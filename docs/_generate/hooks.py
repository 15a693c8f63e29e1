"""MkDocs hooks: the manual's generated parts, made at build time from the code and the results.

A hand-written page holds a marker where generated text goes, and this fills it:

- ``<!-- settings:NAME --><!-- /settings:NAME -->``: a table of settings, from the
  sections' declarations (``service/cli/settings_table.py``);
- ``<!-- generated:cli -->``, ``metrics``, ``log-fields``, ``idl``, ``errors``: the command
  line, the metrics, the log's fields, the IDL and the error types (``collect.py``);
- ``<!-- generated:dashboard-queries -->``: the shipped dashboard's queries
  (``deploy/grafana/dashboard.py``).

Two pages are made whole: ``performance/index.md`` (the newest figures of each results
file in ``docs/performance/``) and ``performance/log.md`` (every run those files hold).
Only these may quote measured figures: a test holds the hand-written pages to that.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import performance  # noqa: E402 (docs/_generate/performance.py, beside this hook)

_collected: dict[str, Any] = {}
_SETTINGS = re.compile(r"<!-- settings:(\w+) -->\n?.*?<!-- /settings:\1 -->", re.DOTALL)
_GENERATED = re.compile(r"<!-- generated:([\w-]+) -->")


def on_config(config: Any) -> Any:
    out = subprocess.run(
        [sys.executable, str(HERE / "collect.py")], check=True, capture_output=True, text=True
    )
    _collected.clear()
    _collected.update(json.loads(out.stdout))
    return config


def on_files(files: Any, config: Any) -> Any:
    results = Path(config["docs_dir"]) / "performance"
    for name, content in performance.pages(results).items():
        files.append(File.generated(config, f"performance/{name}", content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = _SETTINGS.sub(lambda m: _settings(m.group(1), page), markdown)
    return _GENERATED.sub(lambda m: _RENDER[m.group(1)](_collected), markdown)


def _settings(name: str, page: Any) -> str:
    tables = _collected["settings"]
    if name not in tables:
        raise KeyError(f"{page.file.src_uri}: no settings table {name!r}")
    return tables[name]


def _cli(data: dict[str, Any]) -> str:
    parts = []
    for command in data["cli"]["commands"]:
        parts += [
            f"### `{command['name']}`",
            "",
            command["help"] or "",
            "",
            "```text",
            command["usage"],
            "```",
            "",
            "| option | values | meaning |",
            "| --- | --- | --- |",
        ]
        for option in command["options"]:
            flags = ", ".join(f"`{f}`" for f in option["flags"])
            values = (
                ", ".join(f"`{c}`" for c in option["choices"])
                if option["choices"]
                else f"`{option['metavar']}`"
                if option["metavar"]
                else ""
            )
            parts.append(f"| {flags} | {values} | {performance.cell(option['help'])} |")
        parts.append("")
    return "\n".join(parts)


def _metrics(data: dict[str, Any]) -> str:
    rows = [
        "| series (Prometheus) | instrument (OpenTelemetry) | type | unit | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for metric in sorted(data["metrics"], key=lambda m: m["prometheus"]):
        otel = f"`{metric['otel']}`" if metric["otel"] else metric["meter"]
        unit = f"`{metric['unit']}`" if metric["unit"] else ""
        rows.append(
            f"| `{metric['prometheus']}` | {otel} | {metric['kind']} | {unit} | "
            f"{performance.cell(metric['help'])} |"
        )
    return "\n".join(rows) + "\n"


def _log_fields(data: dict[str, Any]) -> str:
    return ", ".join(f"`{name}`" for name in data["log_fields"])


def _idl(data: dict[str, Any]) -> str:
    idl = data["idl"]
    parts = [
        "## Methods of `AppStats`",
        "",
        "| method | arguments | returns | throws |",
        "| --- | --- | --- | --- |",
    ]
    for method in idl["methods"]:
        args = ", ".join(f"{a['id']}: {a['type']} {a['name']}" for a in method["args"])
        parts.append(
            f"| `{method['name']}` | {args} | `{method['returns']}` | "
            f"{', '.join(method['throws'])} |"
        )
    for kind in ("exception", "struct", "union"):
        parts += ["", f"## {kind.capitalize()}s", ""]
        for struct in idl[kind]:
            fields = "; ".join(f"{f['id']}: `{f['type']}` {f['name']}" for f in struct["fields"])
            parts.append(f"- **`{struct['name']}`**: {fields}")
    parts += ["", "## Enums", ""]
    parts += [f"- **`{e['name']}`**: {', '.join(e['values'])}" for e in idl["enum"]]
    parts += ["", "## The IDL itself", "", "```thrift", idl["text"].rstrip(), "```", ""]
    return "\n".join(parts)


def _errors(data: dict[str, Any]) -> str:
    rows = [
        "| exception | module | parent | retry may help | what it means |",
        "| --- | --- | --- | --- | --- |",
    ]
    for error in data["exceptions"]:
        retry = {True: "yes", False: "no", None: ""}[error["retryable"]]
        rows.append(
            f"| `{error['name']}` | `{error['module']}` | {', '.join(error['bases'])} "
            f"| {retry} | {performance.cell(error['doc'])} |"
        )
    return "\n".join(rows) + "\n"


def _dashboard_queries(data: dict[str, Any]) -> str:
    """Every panel's queries, from the script that writes the shipped dashboard."""
    script = HERE.parent.parent / "deploy" / "grafana" / "dashboard.py"
    spec = importlib.util.spec_from_file_location("fanout_dashboard", script)
    assert spec is not None and spec.loader is not None
    dashboard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dashboard)
    lines = []
    for row, panels in dashboard.ROWS:
        for title, _, targets in panels:
            lines.append(f"# {row}: {title}")
            lines.extend(query for query, _ in targets)
    return "```promql\n" + "\n".join(lines) + "\n```"


_RENDER = {
    "cli": _cli,
    "metrics": _metrics,
    "log-fields": _log_fields,
    "idl": _idl,
    "errors": _errors,
    "dashboard-queries": _dashboard_queries,
}
