"""Write the Prometheus Operator's PrometheusRule from the rule files, so that the rules
Kubernetes loads are the ones promtool tests (``make monitoring`` runs it).

Usage: ``python deploy/monitoring/prometheusrule.py [OUT]`` (default
``deploy/kubernetes/monitoring/prometheusrule.yaml``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RULES = sorted((HERE / "rules").glob("*.rules.yaml"))
OUT = HERE.parent / "kubernetes" / "monitoring" / "prometheusrule.yaml"
HEADER = (
    "# Made by deploy/monitoring/prometheusrule.py from deploy/monitoring/rules/: edit those.\n"
)


def prometheus_rule(paths: list[Path]) -> dict[str, Any]:
    """One PrometheusRule holding every group of ``paths``, in order."""
    groups = [group for path in paths for group in yaml.safe_load(path.read_text())["groups"]]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "fanout", "labels": {"app.kubernetes.io/name": "fanout"}},
        "spec": {"groups": groups},
    }


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else OUT
    text = yaml.safe_dump(prometheus_rule(RULES), sort_keys=False, width=1000)
    out.write_text(HEADER + text)


if __name__ == "__main__":
    main(sys.argv[1:])
