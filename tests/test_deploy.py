"""The Kubernetes manifests in deploy/kubernetes: valid (offline schemas) and consistent with fanout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.settings.config import load_settings

MANIFESTS = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = [
        (path.name, doc)
        for path in sorted(MANIFESTS.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    assert {doc["kind"] for _, doc in found} == {"Deployment", "Service", "PodDisruptionBudget"}
    return found


@pytest.mark.parametrize("name, doc", documents())
def test_each_manifest_is_valid_against_the_kubernetes_schema(
    name: str, doc: dict[str, Any]
) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    _, deployment = next((n, d) for n, d in documents() if d["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replicas": "three"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def container() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The Deployment's pod template: its metadata, its spec, and fanout's container."""
    _, deployment = next((n, d) for n, d in documents() if d["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    return template["metadata"], template["spec"], template["spec"]["containers"][0]


def test_the_deployment_configures_fanout_as_its_probes_and_ports_expect() -> None:
    metadata, pod, fanout = container()
    env = {e["name"]: e["value"] for e in fanout["env"] if "value" in e}
    # Kubernetes adds service links for the "fanout" Service; fanout must start anyway.
    settings = load_settings(
        env={**env, "FANOUT_SERVICE_HOST": "10.0.0.7", "FANOUT_PORT_9090_TCP_ADDR": "10.0.0.7"}
    )
    ports = {p["name"]: p["containerPort"] for p in fanout["ports"]}
    assert ports == {
        "thrift": settings.server.port,
        "metrics": settings.metrics.port,
        "probes": settings.server.probe_port,
    }
    assert fanout["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes"}
    assert fanout["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
    assert metadata["annotations"]["prometheus.io/port"] == str(settings.metrics.port)
    pre_stop_s = int(fanout["lifecycle"]["preStop"]["exec"]["command"][-1])
    needed_s = (
        pre_stop_s
        + (
            settings.server.lame_duck_ms
            + settings.server.drain_timeout_ms
            + settings.fanout.abandon_grace_ms
            + settings.tracing.flush_timeout_ms
        )
        / 1000.0
    )
    assert pod["terminationGracePeriodSeconds"] >= needed_s


def test_the_service_is_headless_and_selects_the_pods() -> None:
    _, service = next((n, d) for n, d in documents() if d["kind"] == "Service")
    _, deployment = next((n, d) for n, d in documents() if d["kind"] == "Deployment")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]


def test_the_deployment_runs_the_image_make_image_tags() -> None:
    """``make image`` tags ``fanout:<version>``; the Deployment must name that image."""
    import tomllib

    version = tomllib.loads((MANIFESTS.parents[1] / "pyproject.toml").read_text())["project"][
        "version"
    ]
    _, pod, fanout = container()
    assert fanout["image"] == f"fanout:{version}"
    assert fanout["command"] == ["fanout", "serve"]  # the image has no ENTRYPOINT
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_deployment_gives_each_worker_a_cpu_and_its_memory() -> None:
    """One worker per CPU; about 100 MiB per worker (65-95 MiB measured) plus the master."""
    _, _, fanout = container()
    workers = int(next(e["value"] for e in fanout["env"] if e["name"] == "FANOUT_SERVER_WORKERS"))
    requests = fanout["resources"]["requests"]
    assert int(requests["cpu"]) == workers
    assert int(requests["memory"].removesuffix("Mi")) >= 95 * workers + 40


# --- mutual TLS with cert-manager (deploy/kubernetes/cert-manager) ------------------------------

CERT_MANAGER = MANIFESTS / "cert-manager"


def _merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A strategic merge as kubectl does it for what the patch holds: maps merge, and lists
    of named items merge by name (containers) or append (env, volumes, mounts)."""
    merged = dict(base)
    for key, value in patch.items():
        old = merged.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            merged[key] = _merged(old, value)
        elif isinstance(value, list) and isinstance(old, list) and key == "containers":
            by_name = {item["name"]: item for item in value}
            merged[key] = [_merged(item, by_name.get(item["name"], {})) for item in old]
        elif isinstance(value, list) and isinstance(old, list):
            merged[key] = old + value
        else:
            merged[key] = value
    return merged


def _mtls() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The Deployment with the mutual-TLS patch applied, and the cert-manager objects by name."""
    _, deployment = next((n, d) for n, d in documents() if d["kind"] == "Deployment")
    patch = yaml.safe_load((CERT_MANAGER / "mtls-patch.yaml").read_text())
    objects = {
        doc["metadata"]["name"]: doc
        for doc in yaml.safe_load_all((CERT_MANAGER / "certificates.yaml").read_text())
    }
    return _merged(deployment, patch), objects


def test_the_mutual_tls_deployment_is_valid_and_its_settings_load() -> None:
    deployment, certificates = _mtls()
    kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
    pod = deployment["spec"]["template"]["spec"]
    fanout = pod["containers"][0]
    env = {e["name"]: e["value"] for e in fanout["env"] if "value" in e}
    server = load_settings(env=env).server
    assert server.tls_client_names == (
        "web.default.svc",
        "spiffe://cluster.local/ns/default/sa/web",
    )
    # Each file comes from the serving certificate's Secret, mounted as a directory: a subPath
    # mount would never see cert-manager's renewals.
    mount = next(m for m in fanout["volumeMounts"] if m["name"] == "tls")
    assert "subPath" not in mount and mount["readOnly"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == certificates["fanout-server"]["spec"]["secretName"]
    for path in (server.tls_cert_file, server.tls_key_file, server.tls_client_ca_file):
        assert Path(path).parent == Path(mount["mountPath"])
        assert Path(path).name in ("tls.crt", "tls.key", "ca.crt")  # a cert-manager Secret's keys
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_cert_manager_names_what_the_server_and_its_allow_list_expect() -> None:
    deployment, certificates = _mtls()
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    allowed = set(load_settings(env=env).server.tls_client_names)
    server_cert, client_cert = (
        certificates["fanout-server"]["spec"],
        certificates["web-tier-client"]["spec"],
    )
    assert "server auth" in server_cert["usages"] and "client auth" in client_cert["usages"]
    service = next(d for _, d in documents() if d["kind"] == "Service")
    assert service["metadata"]["name"] in server_cert["dnsNames"]
    assert set(client_cert["dnsNames"] + client_cert["uris"]) <= allowed
    assert server_cert["issuerRef"]["name"] == client_cert["issuerRef"]["name"] == "fanout-ca"
    kustomization = yaml.safe_load((CERT_MANAGER / "kustomization.yaml").read_text())
    assert {Path(r).name for r in kustomization["resources"]} == {
        "deployment.yaml",
        "service.yaml",
        "pdb.yaml",
        "certificates.yaml",
    }
    assert kustomization["patches"] == [{"path": "mtls-patch.yaml"}]
