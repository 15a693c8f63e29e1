"""What operators install beside a service (deploy/monitoring/): the rules load in a real
Prometheus's promtool, every alert fires and stays silent as its unit tests say, and every
alert carries what the runbooks page promises."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.toolchains import needs

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "monitoring"
RULE_FILES = sorted((MONITORING / "rules").glob("*.rules.yaml"))
RULE_TESTS = sorted((MONITORING / "rules" / "tests").glob("*.test.yaml"))
RUNBOOKS = ROOT / "docs" / "operations" / "runbooks.md"
SEVERITIES = {"page", "ticket"}


def _alerts(path: Path) -> list[dict[str, Any]]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_there_are_rule_files_and_unit_tests() -> None:
    names = {path.name for path in RULE_FILES}
    assert {"alerts.rules.yaml", "slo.rules.yaml"} <= names, names
    assert RULE_TESTS


@needs("prometheus")
@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_finds_nothing_wrong_in_the_rules(path: Path) -> None:
    checked = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs("prometheus")
@pytest.mark.parametrize("path", RULE_TESTS, ids=lambda p: p.name)
def test_each_alert_fires_and_stays_silent_as_its_unit_test_says(path: Path) -> None:
    tested = subprocess.run(
        ["promtool", "test", "rules", path.name],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section() -> None:
    headings = {
        line[3:].strip().lower() for line in RUNBOOKS.read_text().splitlines() if line[:3] == "## "
    }
    for path in RULE_FILES:
        for rule in _alerts(path):
            name, labels, notes = rule["alert"], rule["labels"], rule["annotations"]
            assert labels.get("severity") in SEVERITIES, (path.name, name, labels)
            assert notes.get("summary"), (path.name, name)
            anchor = notes["runbook_url"].rsplit("#", 1)[1]
            assert anchor == name.lower() and anchor in headings, (path.name, name, anchor)


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tested = {
        case["alertname"]
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    alerts = {rule["alert"] for path in RULE_FILES for rule in _alerts(path)}
    assert len(alerts) >= 12 and alerts <= tested, alerts - tested


def test_the_slo_rules_hold_the_objectives_and_queries_of_slos_yaml() -> None:
    """slo.rules.yaml is made from slos.yaml by Sloth (make monitoring): an objective or an
    SLI changed in one and not made again in the other fails here."""
    slos = yaml.safe_load((MONITORING / "slos.yaml").read_text())["slos"]
    groups = yaml.safe_load((MONITORING / "rules" / "slo.rules.yaml").read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    objectives = {
        rule["labels"]["sloth_slo"]: float(rule["expr"].strip()[len("vector(") : -1])
        for rule in rules
        if rule.get("record") == "slo:objective:ratio"
    }
    assert objectives == {slo["name"]: pytest.approx(slo["objective"] / 100) for slo in slos}, (
        objectives
    )
    five_minutes = {
        rule["labels"]["sloth_slo"]: _words(rule["expr"])
        for rule in rules
        if rule.get("record") == "slo:sli_error:ratio_rate5m"
    }
    for slo in slos:
        for query in slo["sli"]["events"].values():
            assert _words(query.replace("{{.window}}", "5m")) in five_minutes[slo["name"]], slo


def _words(expr: str) -> str:
    return " ".join(expr.split())


def test_the_prometheus_rule_object_holds_exactly_the_rule_files_rules() -> None:
    """deploy/kubernetes/monitoring/prometheusrule.yaml is made from the rule files
    (make monitoring): a rule changed in one and not made again in the other fails here."""
    shipped = yaml.safe_load(
        (ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml").read_text()
    )
    assert shipped["kind"] == "PrometheusRule"
    assert shipped["apiVersion"] == "monitoring.coreos.com/v1"
    groups = [group for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]]
    assert shipped["spec"]["groups"] == groups


def test_the_prometheus_rule_generator_writes_the_shipped_file(tmp_path: Path) -> None:
    """Run as ``make monitoring`` runs it: what it writes now is, to the byte, the file the
    repository ships (and it writes the header that says where to edit)."""
    import subprocess
    import sys

    made = tmp_path / "prometheusrule.yaml"
    subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "monitoring" / "prometheusrule.py"), str(made)],
        check=True,
        timeout=60,
    )
    shipped = ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
    assert made.read_text() == shipped.read_text()
    assert made.read_text().startswith("# Made by deploy/monitoring/prometheusrule.py")


def _dashboard_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy/grafana/dashboard.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dashboard_file_is_the_one_its_panels_make() -> None:
    """deploy/grafana/fanout.json is made by deploy/grafana/dashboard.py (make monitoring)."""
    import json

    made = _dashboard_module().dashboard()
    shipped = json.loads((ROOT / "deploy" / "grafana" / "fanout.json").read_text())
    assert shipped == made
    titles = [p["title"] for p in shipped["panels"] if p["type"] == "timeseries"]
    assert len(titles) == len(set(titles)) >= 12, titles


def test_the_dashboard_script_writes_where_it_is_told_and_help_writes_nothing(
    tmp_path: Path,
) -> None:
    import json
    import sys

    script = str(ROOT / "deploy" / "grafana" / "dashboard.py")
    helped = subprocess.run(
        [sys.executable, script, "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "usage:" in helped.stdout
    assert list(tmp_path.iterdir()) == []
    subprocess.run([sys.executable, script, str(tmp_path / "out.json")], check=True)
    shipped = json.loads((ROOT / "deploy" / "grafana" / "fanout.json").read_text())
    assert json.loads((tmp_path / "out.json").read_text()) == shipped


@needs("prometheus")
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """Each query as Prometheus reads it, Grafana's variables filled in: promtool checks it
    as a recording rule's expression."""
    exprs = [
        expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
        for expr in _dashboard_module().queries()
    ]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


#: A series an alert stands on: ours, the RPC histogram's, a recording rule's, or up.
_SERIES = re.compile(r"\b(fanout_\w+|rpc_server_\w+|slo:\w+(?::\w+)*|up)\b")


def _series_of(expr: str) -> set[str]:
    """The series an expression reads (a histogram's or a recording rule's by its family)."""
    names = set()
    for name in _SERIES.findall(expr):
        if name.startswith("slo:"):
            name = "slo:"  # the SLO alerts read Sloth's rules; the budget left shows them
        names.add(re.sub(r"_(bucket|count|sum)$", "", name))
    return names


def test_every_alerts_signal_has_a_dashboard_panel() -> None:
    shown = set().union(*(_series_of(query) for query in _dashboard_module().queries()))
    for path in RULE_FILES:
        for alert in _alerts(path):
            missing = _series_of(alert["expr"]) - shown
            assert not missing, f"{alert['alert']}: no dashboard panel shows {sorted(missing)}"
