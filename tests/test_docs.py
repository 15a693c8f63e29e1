"""The manual: it builds strictly, its reference is complete, it quotes no measured figure
by hand, and the README stays a short front page that points into it."""

from __future__ import annotations

import argparse
import html
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import figures

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PRODUCT = ("service", "lookups", "tracing")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The manual, built as `make docs` builds it (strict), into a folder of its own."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's text, tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", " ", (site / page).read_text()))


def test_the_site_works_offline_from_its_folder(site: Path) -> None:
    home = (site / "index.html").read_text()
    assert 'href="tutorial/index.html"' in home, "pages link as files, not folders"
    assert "fonts.googleapis" not in home and "fonts.gstatic" not in home
    assert (site / "performance" / "index.html").exists() and (
        site / "performance" / "log.html"
    ).exists()
    for image in re.findall(
        r'<img[^>]+src="([^"]+)"', (site / "how-to" / "tracing.html").read_text()
    ):
        assert (site / "how-to" / image).resolve().exists(), image


def test_every_page_loads_what_it_needs_from_the_site_and_search_reads_an_inlined_index(
    site: Path,
) -> None:
    """Opened from disk with no network, a page loads no script, stylesheet or image from
    elsewhere, and search finds its index as a script beside it (docs/_generate/offline.py)."""
    loaded = re.compile(r'<(?:script|link|img)\b[^>]*?\b(?:src|href)="([^"#]+)"')
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 40
    for page in pages:
        for url in loaded.findall(page.read_text()):
            assert not re.match(r"(https?:)?//", url), f"{page.relative_to(site)} loads {url}"
            base = site if url.startswith("/") else page.parent  # 404.html: from the root
            assert (base / url.split("?")[0].lstrip("/")).resolve().exists(), (page, url)
    assert (
        '<script src="assets/javascripts/iframe-worker-shim.js">'
        in (site / "index.html").read_text()
    )
    index = (site / "search" / "search_index.json").read_text()
    assert (site / "search" / "search_index.js").read_text() == "var __index = " + index


def test_a_newcomer_reaches_each_goal_from_the_home_page_in_one_click(site: Path) -> None:
    home = (site / "index.html").read_text()
    for target in (
        "tutorial/index.html",
        "how-to/kubernetes.html",
        "how-to/real-backends.html",
        "how-to/monitor.html",
        "how-to/size-pools.html",
        "reference/client-api.html",
    ):
        assert f'href="{target}"' in home, target
    text = page_text(site, "index.html")
    assert re.search(r"make\s+demo", text) and re.search(r"make\s+test", text)


def test_the_settings_reference_names_every_key(site: Path) -> None:
    from lookups.backends.settings import BACKEND_KINDS
    from service.settings.config import _SECTIONS
    from service.settings.declarations import keys_of

    text = (
        page_text(site, "reference/settings.html")
        + page_text(site, "how-to/backends.html")
        + page_text(site, "how-to/tracing.html")
        + page_text(site, "reference/metrics.html")
        + page_text(site, "how-to/results-cache.html")
    )
    sections = dict(_SECTIONS)
    assert len(sections) >= 8
    for name, section in sections.items():
        prefix = "lookups.<name>" if name == "lookups" else name
        for key in keys_of(section):
            assert f"{prefix}.{key.name}" in text, f"{prefix}.{key.name}"
    for section in BACKEND_KINDS.values():
        for key in keys_of(section):
            assert key.name in page_text(site, "how-to/backends.html"), key.name


def test_the_command_line_reference_names_every_command_and_option(site: Path) -> None:
    from service.cli.main import _parser

    text = page_text(site, "reference/cli.html")
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(commands.choices) >= 6
    for name, command in commands.choices.items():
        assert f"fanout {name}" in text, name
        for action in command._actions:
            for flag in action.option_strings:
                assert flag in text, f"fanout {name} {flag}"


def _import_product() -> None:
    for name in PRODUCT:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if ".samples" not in info.name and not info.name.endswith("__main__"):
                importlib.import_module(info.name)


def test_the_metrics_reference_names_every_instrument(site: Path) -> None:
    from opentelemetry.metrics import _internal as otel_metrics

    from service.workers.group import GROUP_SERIES

    _import_product()
    text = page_text(site, "reference/metrics.html")
    # Our own meters; the requests instrumentation's histogram is named in the page's table.
    names = [
        instrument._name
        for meter in otel_metrics._PROXY_METER_PROVIDER._meters
        if meter._name.startswith("fanout")
        for instrument in meter._instruments
    ]
    assert len(names) >= 30
    assert "http_client_request_duration_seconds" in text
    for name in names:
        assert name in text, name
        assert name.replace(".", "_") in text, name
    for name, _, _ in GROUP_SERIES:
        assert name in text, name


def test_the_monitoring_page_shows_every_query_of_the_shipped_dashboard(site: Path) -> None:
    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy/grafana/dashboard.py")
    assert spec is not None and spec.loader is not None
    dashboard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dashboard)
    # Highlighting splits a query into tags: compared without the spaces they leave.
    text = re.sub(r"\s+", "", page_text(site, "how-to/monitor.html"))
    queries = dashboard.queries()
    assert len(queries) >= 20
    for query in queries:
        assert re.sub(r"\s+", "", query) in text, query


def test_the_idl_reference_names_every_method_type_and_exception(site: Path) -> None:
    from service.idl import appstats

    text = page_text(site, "reference/idl.html")
    methods = appstats.AppStats.thrift_services
    assert "get_app_stats" in methods
    for method in methods:
        assert f"{method}" in text, method
    for name, value in vars(appstats).items():
        if inspect.isclass(value) and hasattr(value, "thrift_spec") and not name.startswith("_"):
            assert name in text, name
            for _, spec in value.thrift_spec.items():
                assert spec[1] in text, f"{name}.{spec[1]}"


def test_the_errors_reference_names_every_public_exception(site: Path) -> None:
    _import_product()
    text = page_text(site, "reference/errors.html")
    found = []
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name.split(".")[0] not in PRODUCT or ".samples" in name:  # the demo's backends
            continue
        for exported in getattr(module, "__all__", ()):
            value = getattr(module, exported, None)
            if inspect.isclass(value) and issubclass(value, BaseException):
                found.append(exported)
    assert {"LookupFailed", "ConfigError", "WireError"} <= set(found)
    for name in found:
        assert name in text, name
    for name in ("InvalidRequest", "Overloaded", "PanelFailed"):
        assert name in text, name


def test_the_python_api_pages_come_from_the_docstrings(site: Path) -> None:
    from lookups import base
    from service.client import AppStatsClient

    client = page_text(site, "reference/client-api.html")
    for name, member in vars(AppStatsClient).items():
        if not name.startswith("_") and callable(member) and member.__doc__:
            assert name in client, name
    lookup = page_text(site, "reference/lookup-api.html")
    assert (inspect.getdoc(base.Lookup) or "").split("\n")[0][:40] in lookup


def test_the_performance_pages_are_made_from_every_results_file(site: Path) -> None:
    import json

    spec = importlib.util.spec_from_file_location("pages", DOCS / "_generate" / "performance.py")
    assert spec is not None and spec.loader is not None
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    superseded: dict[str, str] = pages.SUPERSEDED

    text = page_text(site, "performance/index.html")
    log = page_text(site, "performance/log.html")
    files = sorted(DOCS.glob("performance/*.json"))
    assert len(files) >= 5 and set(superseded) <= {path.name for path in files}
    for path in files:
        # Today's runs on the index; a superseded run's figures on the log page only.
        shown_in = log if path.name in superseded else text
        assert path.name in log and (path.name in text) == (path.name not in superseded)
        data = json.loads(path.read_text())
        for goal in data.get("goals", []) if isinstance(data.get("goals"), list) else []:
            assert goal["shown"] in shown_in, goal["text"]
        if "machine" in data:
            assert data["machine"]["date_utc"] in shown_in


def test_each_plot_is_shown_once_under_the_newest_run_that_drew_it(site: Path) -> None:
    """A run writes its plots over the last one's: an older run's section shows none of them."""
    import json

    index = (site / "performance" / "index.html").read_text()
    shown = re.findall(r'<img[^>]+src="([^"]+\.png)"', index)
    assert shown and len(shown) == len(set(shown)), shown
    runs = [json.loads(path.read_text()) for path in DOCS.glob("performance/*.json")]
    drawn = {plot for run in runs if "machine" in run for plot in run.get("plots") or []}
    assert set(shown) <= drawn
    assert "<img" not in (site / "performance" / "log.html").read_text()


def hand_written_pages() -> list[Path]:
    return [*DOCS.rglob("*.md"), ROOT / "README.md", ROOT / "tests" / "README.md"]


def test_no_hand_written_page_quotes_a_measured_figure() -> None:
    pages = hand_written_pages()
    assert len(pages) >= 30
    found = [
        f"{path.relative_to(ROOT)} {figure}"
        for path in pages
        for figure in figures.in_markdown(path.read_text())
    ]
    assert found == [], "a figure belongs in docs/performance/*.json:\n" + "\n".join(found)


def test_no_comment_or_docstring_in_the_product_quotes_a_measured_figure() -> None:
    modules = [path for name in PRODUCT for path in (ROOT / name).rglob("*.py")]
    assert len(modules) >= 100
    found = [
        f"{path.relative_to(ROOT)} {figure}"
        for path in modules
        for figure in figures.in_python(path.read_text())
    ]
    assert found == [], "a figure belongs in docs/performance/*.json:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        ("CPU per call 0.93x the hand-written server", ["ratio"]),
        ("a refusal cost 92-100 µs, then 59-67 µs", ["range", "range"]),
        ("it took the median from 521 ms to 57 ms", ["from-to"]),
        ("about 550 refusals a second", ["rate"]),
        ("358.9 ± 5.1, and 435 → 453", ["decimal time", "plus-minus", "arrow"][1:]),
        ("four runs on 26 November", ["dated run"]),
        ("an idle connection holds about 11 KiB", ["about"]),
        ("with the probe it held a limit of 101", ["outcome"]),
        ("the level settled between 6 and 47 each run", ["between"]),
        ("from 531 to 544 a second in `make bench`", ["range rate"]),
        ("the dimmer took about a third of the calls", ["share"]),
        ("a cold fill needs 53 s here", ["here"]),
        ("eight times the period (8x: 16 s)", ["times ratio"]),
        ("formatting the stack, measured once at 120 ms", ["measured at"]),
        ("a limit between `min_limit` and `max_limit`, stays at `initial_limit`", []),
        ("the limit is `server.frame_timeout_ms` (5000 ms), every 500 ms", []),
        ("`cache 99.6% of 48210 buckets read`, a sample line", []),
    ],
)
def test_the_figure_finder_finds_figures_and_leaves_settings(text: str, kinds: list[str]) -> None:
    assert [figure.kind for figure in figures.in_markdown(text)] == kinds


def test_the_figure_finder_reads_comments_and_docstrings_not_code_or_samples() -> None:
    source = (
        '"""A module.\n\nIt took 1.5 s.\n\nSample::\n\n    201.3 ms  3 spans\n"""\n'
        'TIMEOUT_S = 0.5  # measured 0.4 s here\nNAME = "0.9x"\n'
    )
    assert {f.line for f in figures.in_python(source)} == {3, 9}


def test_every_path_the_contributor_pages_name_exists() -> None:
    """The layout the contributor pages describe is the tree's (the modules' own tests
    are listed in tests/README.md, which tests/test_layout.py holds to the tree)."""
    named = set()
    for page in (DOCS / "contributing").glob("*.md"):
        named |= set(
            re.findall(
                r"`((?:service|lookups|tracing|tests|bench|docs|deploy)/"
                r"[\w./-]*)`",
                page.read_text(),
            )
        )
    assert len(named) >= 20
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == [], missing


def test_the_readme_is_a_short_front_page_pointing_into_the_manual() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 150, len(lines)
    assert lines[0] == "# Fanout" and "make demo" in lines[3] and "make test" in lines[4]
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).exists(), link
