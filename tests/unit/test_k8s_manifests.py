"""deploy/k8s/validate.py (`make lint`): the repository's manifests pass it, offline, against Kubernetes' schemas;
a broken copy is refused, naming the file and the field. The NATS Helm values make a configuration nats-server
accepts. The gateway's pods hold no Secret and reach NATS and DNS only, and the process its manifest runs answers
the manifest's probes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devstack.servers import free_port, nats_server_binary
from devstack.stack import REPO_ROOT
from libs.natsauth import issuer_public_key, new_issuer_seed
from tests.support.scripts import load_script
from tests.support.waiting import eventually

K8S = REPO_ROOT / "deploy" / "k8s"


validator = load_script(K8S / "validate.py", "trainyard_k8s_validate")


def documents(path: Path) -> list[Any]:
    with path.open() as stream:
        return [document for document in yaml.safe_load_all(stream) if document is not None]


def rewrite(path: Path, change: Callable[[list[Any]], None]) -> None:
    found = documents(path)
    change(found)
    path.write_text(yaml.safe_dump_all(found, sort_keys=False))


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return copy


def test_the_repository_manifests_pass() -> None:
    results = validator.validate_directory(K8S)
    assert [result.line() for result in results if not result.ok] == []
    kinds = [result.kind for result in results]
    assert kinds.count("Deployment") == 5 and kinds.count("PodDisruptionBudget") == 5
    assert kinds.count("DaemonSet") == 1 and kinds.count("NetworkPolicy") >= 5
    assert {"PodMonitor", "PrometheusRule", "Kustomization", "HelmValues", "Service", "Ingress"} <= set(kinds)


def test_every_document_gets_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert validator.main([str(K8S)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(validator.validate_directory(K8S))
    assert all(line.endswith("  ok") for line in lines)
    assert any("scheduler.yaml" in line and "Deployment/trainyard-scheduler" in line for line in lines)


def set_replicas(found: list[Any]) -> None:
    found[0]["spec"]["replicas"] = "two"


def add_unknown_field(found: list[Any]) -> None:
    found[0]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"


def escalate(found: list[Any]) -> None:
    found[0]["spec"]["template"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True


def drop_expr(found: list[Any]) -> None:
    rule = next(document for document in found if document["kind"] == "PrometheusRule")
    del rule["spec"]["groups"][0]["rules"][0]["expr"]


def unknown_kind(found: list[Any]) -> None:
    found.append({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


def drop_subject(found: list[Any]) -> None:
    found[0]["config"]["merge"]["authorization"]["users"][0]["permissions"]["publish"]["allow"].pop()


def two_servers(found: list[Any]) -> None:
    found[0]["config"]["cluster"]["replicas"] = 2


def gateway_container_in(found: list[Any]) -> dict[str, Any]:
    [deployment] = [document for document in found if document["kind"] == "Deployment"]
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def give_the_gateway_the_database(found: list[Any]) -> None:
    gateway_container_in(found)["env"].append(
        {"name": "DATABASE_URL", "valueFrom": {"secretKeyRef": {"name": "trainyard-database", "key": "scheduler"}}})


def give_the_gateway_a_secret_by_another_name(found: list[Any]) -> None:
    gateway_container_in(found)["env"].append(
        {"name": "SIGNING", "valueFrom": {"secretKeyRef": {"name": "trainyard-auth", "key": "TRAINYARD_AUTH_SECRET"}}})


def mount_the_issuer_key_in_the_gateway(found: list[Any]) -> None:
    [deployment] = [document for document in found if document["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["volumes"].append(
        {"name": "nats-issuer", "secret": {"secretName": "trainyard-nats-issuer"}})


def policy(found: list[Any], name: str) -> dict[str, Any]:
    named: list[dict[str, Any]] = [document for document in found if document["metadata"]["name"] == name]
    [one] = named
    return one


def let_the_gateway_reach_postgres(found: list[Any]) -> None:
    policy(found, "trainyard-services-egress")["spec"]["podSelector"]["matchExpressions"][0]["values"].append("gateway")


def let_the_gateway_reach_any_port_of_nats(found: list[Any]) -> None:
    del policy(found, "trainyard-gateway")["spec"]["egress"][0]["ports"]


def open_another_port_of_the_gateway(found: list[Any]) -> None:
    policy(found, "trainyard-gateway")["spec"]["ingress"][0]["ports"].append({"protocol": "TCP", "port": 5000})




@pytest.mark.parametrize(("file", "change", "expected"), [
    ("scheduler.yaml", set_replicas, "spec.replicas: 'two' is not of type 'integer'"),
    ("launcher.yaml", add_unknown_field, "spec.template.spec.containers[0]: Additional properties are not allowed "
                                         "('imagePullPolicyy' was unexpected)"),
    ("agent.yaml", escalate,
     "spec.template.spec.containers[0].securityContext.allowPrivilegeEscalation: must be false"),
    ("monitoring.yaml", drop_expr, "spec.groups[0].rules[0]: missing required field(s) expr"),
    ("storage.yaml", unknown_kind, "kind: Couldn't find schema for kind Widget"),
    ("helm/nats-values.yaml", drop_subject,
     "config.merge.authorization.users[0].permissions.publish.allow: differs from the roles of libs/natsroles.py"),
    ("helm/nats-values.yaml", two_servers, "config.cluster.replicas: must be 3 or more"),
    ("gateway.yaml", give_the_gateway_the_database,
     "spec.template.spec.containers[0].env[3].name: DATABASE_URL is a credential of the control plane"),
    ("gateway.yaml", give_the_gateway_a_secret_by_another_name,
     "spec.template.spec.containers[0].env[3].valueFrom.secretKeyRef: must be no Secret"),
    ("gateway.yaml", mount_the_issuer_key_in_the_gateway, "spec.template.spec.volumes[1].secret: must mount no Secret"),
    ("network-policies.yaml", let_the_gateway_reach_postgres,
     "spec.egress[1].ports[0]: TCP 5432: the gateway may reach NATS (TCP 4222), DNS (UDP 53 or TCP 53), an OTLP/HTTP "
     "collector (TCP 4318) only (it selects the pods of Deployment trainyard-gateway)"),
    ("network-policies.yaml", let_the_gateway_reach_any_port_of_nats,
     "spec.egress[0]: must name its ports: without, it opens every port to the gateway"),
    ("network-policies.yaml", open_another_port_of_the_gateway,
     "spec.ingress[0].ports[1]: 5000: the gateway's containers declare no such port"),
])
def test_a_broken_manifest_is_refused_naming_the_file_and_field(
        manifests: Path, capsys: pytest.CaptureFixture[str], file: str, change: Callable[[list[Any]], None],
        expected: str) -> None:
    rewrite(manifests / file, change)
    assert validator.main([str(manifests)]) == 1
    out = capsys.readouterr()
    errors = [line for line in out.out.splitlines() if "ERROR" in line]
    assert len(errors) == 1, out.out
    assert errors[0].startswith(str(manifests / file)), errors[0]
    assert expected in errors[0], errors[0]
    assert "1 of" in out.err and "checks failed" in out.err


def test_a_deployment_without_a_disruption_budget_or_left_out_of_the_kustomization_is_refused(
        manifests: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rewrite(manifests / "pdb.yaml", lambda found: found.pop(0))
    rewrite(manifests / "kustomization.yaml", lambda found: found[0]["resources"].remove("network-policies.yaml"))
    assert validator.main([str(manifests)]) == 1
    errors = [line for line in capsys.readouterr().out.splitlines() if "ERROR" in line]
    assert len(errors) == 2, errors
    assert "Deployment/trainyard-scheduler" in errors[0] and "no PodDisruptionBudget" in errors[0]
    assert "kustomization.yaml" in errors[1] and "network-policies.yaml missing" in errors[1]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [document for path in sorted(K8S.glob("*.yaml")) for document in documents(path)
                                   if document["kind"] == kind and document["metadata"]["name"] == name]
    [one] = found
    return one


def keys_within(value: Any) -> Iterator[str]:
    """Every mapping key anywhere inside `value`."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key
            yield from keys_within(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from keys_within(inner)


def test_the_gateway_holds_no_secret_and_reaches_only_nats_and_dns() -> None:
    gateway = k8s_object("Deployment", "trainyard-gateway")
    pod = gateway["spec"]["template"]["spec"]
    assert not {"secret", "secretRef", "secretKeyRef", "secretName"} & set(keys_within(gateway))
    assert pod["automountServiceAccountToken"] is False
    [container] = pod["containers"]
    assert not {variable["name"] for variable in container["env"]} & validator.CREDENTIAL_VARIABLES
    settings = {source["configMapRef"]["name"] for source in container["envFrom"]}
    assert settings == {"trainyard-env"}
    assert not set(k8s_object("ConfigMap", "trainyard-env")["data"]) & validator.CREDENTIAL_VARIABLES

    labels = gateway["spec"]["template"]["metadata"]["labels"]
    policies = [policy for policy in documents(K8S / "network-policies.yaml")
                if validator.matches(policy["spec"]["podSelector"], labels)]
    egress = {(peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"], port["protocol"], port["port"])
              for policy in policies if "Egress" in policy["spec"]["policyTypes"]
              for rule in policy["spec"].get("egress", []) for peer in rule["to"] for port in rule["ports"]}
    assert egress == {("nats", "TCP", 4222), ("kube-system", "UDP", 53), ("kube-system", "TCP", 53)}
    assert any(policy["metadata"]["name"] == "trainyard-default-deny" for policy in policies)
    ingress = {port["port"] for policy in policies for rule in policy["spec"].get("ingress", [])
               for port in rule["ports"]}
    assert ingress == {8080, 9464}
    # The NATS it is let out to is the one it is told to use.
    nats_url = k8s_object("ConfigMap", "trainyard-env")["data"]["NATS_URL"]
    assert nats_url == "nats://nats.nats.svc.cluster.local:4222"


def test_the_gateway_is_served_to_the_service_and_ingress_on_the_port_it_listens_on() -> None:
    [container] = k8s_object("Deployment", "trainyard-gateway")["spec"]["template"]["spec"]["containers"]
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    assert env["TRAINYARD_HTTP_ADDRESS"] == "0.0.0.0:8080"
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    service = k8s_object("Service", "trainyard-gateway")["spec"]
    assert [(port["name"], port["targetPort"]) for port in service["ports"]] == [("http", "http")]
    ingress = k8s_object("Ingress", "trainyard-gateway")["spec"]
    [path] = ingress["rules"][0]["http"]["paths"]
    assert path["backend"]["service"] == {"name": "trainyard-gateway", "port": {"name": "http"}}
    # An example to adapt (its host, certificate and controller), so kubectl apply -k leaves it out.
    [kustomization] = documents(K8S / "kustomization.yaml")
    assert "gateway.yaml" in kustomization["resources"]
    assert "gateway-ingress.example.yaml" not in kustomization["resources"]


def test_a_gateway_given_a_credential_through_its_settings_or_left_unfenced_is_refused(
        manifests: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def database_in_settings(found: list[Any]) -> None:
        found[0]["data"]["DATABASE_URL"] = "postgresql://scheduler:secret@db.example.internal:5432/trainyard"

    def unfence(found: list[Any]) -> None:
        found[:] = [policy for policy in found
                    if policy["metadata"]["name"] not in ("trainyard-default-deny", "trainyard-gateway")]

    rewrite(manifests / "config.yaml", database_in_settings)
    rewrite(manifests / "network-policies.yaml", unfence)
    assert validator.main([str(manifests)]) == 1
    errors = [line for line in capsys.readouterr().out.splitlines() if "ERROR" in line]
    # trainyard-allow-metrics still limits what comes in (port 9464 alone); nothing limits what goes out.
    assert len(errors) == 2, errors
    assert all(line.startswith(str(manifests / "gateway.yaml")) and "Deployment/trainyard-gateway" in line
               for line in errors), errors
    assert "its environment comes from ConfigMap trainyard-env, which holds DATABASE_URL" in errors[0]
    assert errors[1].endswith("no NetworkPolicy limits its pods' egress")


@dataclass
class DeployedGateway:
    process: subprocess.Popen[bytes]
    log: Path
    http_port: int
    metrics_port: int

    async def get(self, client: httpx.AsyncClient, port: int, path: str) -> httpx.Response | None:
        """The answer at `path`, or None while nothing listens yet; a gateway that exited fails the test."""
        assert self.process.poll() is None, f"the gateway exited ({self.process.returncode}):\n{self.log.read_text()}"
        try:
            return await client.get(f"http://127.0.0.1:{port}{path}")
        except httpx.TransportError:
            return None


def gateway_container() -> dict[str, Any]:
    [container] = k8s_object("Deployment", "trainyard-gateway")["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


@pytest.fixture
def gateway_as_deployed(tmp_path: Path) -> Iterator[DeployedGateway]:
    """The command of gateway.yaml with its environment and trainyard-env's (its NATS unreachable here: nothing is
    asked of NATS before a request), on free ports of 127.0.0.1 instead of the pod's 0.0.0.0."""
    container = gateway_container()
    assert container["command"][0] == "python"
    http_port, metrics_port = free_port(), free_port()
    env = {**os.environ, **k8s_object("ConfigMap", "trainyard-env")["data"],
           **{variable["name"]: variable["value"] for variable in container["env"]},
           "TRAINYARD_HTTP_ADDRESS": f"127.0.0.1:{http_port}", "TRAINYARD_METRICS_PORT": str(metrics_port),
           "TRAINYARD_METRICS_ADDRESS": "127.0.0.1"}
    log = tmp_path / "gateway.log"
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, *container["command"][1:]], cwd=REPO_ROOT, env=env,
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        yield DeployedGateway(process, log, http_port, metrics_port)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_the_gateway_the_manifest_runs_answers_its_probes_and_serves_metrics(
        gateway_as_deployed: DeployedGateway) -> None:
    gateway = gateway_as_deployed
    container = gateway_container()
    paths = {container[probe]["httpGet"]["path"] for probe in ("readinessProbe", "livenessProbe")}
    async with httpx.AsyncClient() as client:
        for path in paths:  # without a token, as the kubelet asks
            probed = await eventually(lambda path=path: gateway.get(client, gateway.http_port, path))  # type: ignore[misc]
            assert (probed.status_code, probed.text) == (200, "ok")
        metrics = await eventually(lambda: gateway.get(client, gateway.metrics_port, "/metrics"))
        assert metrics.status_code == 200 and "# TYPE process_cpu_seconds_total counter" in metrics.text


def chart_config(values: dict[str, Any], store: Path) -> str:
    """The nats.conf the chart makes of the values, as far as they shape it: its own settings, then
    `config.merge` over them, written as JSON with `<< … >>` strings unquoted (the chart's nats.formatConfig)."""
    config = values["config"]
    servers, jetstream = config["cluster"]["replicas"], config["jetstream"]
    conf: dict[str, Any] = {
        "server_name": "nats-0", "port": 4222, "http_port": 8222,
        "cluster": {"name": "nats", "port": 6222, "no_advertise": True,
                    "routes": [f"nats://nats-{i}.nats-headless:6222" for i in range(servers)]},
        "jetstream": {"store_dir": str(store), "max_file_store": f"<< {jetstream['fileStore']['pvc']['size']} >>",
                      **jetstream["merge"]},
        **config["merge"],
    }
    return re.sub(r'"<<\s+(.*)\s+>>"', r"\1", json.dumps(conf, indent=2))


def test_the_nats_values_make_a_configuration_nats_server_accepts(tmp_path: Path) -> None:
    [values] = documents(K8S / "helm" / "nats-values.yaml")
    config = tmp_path / "nats.conf"
    config.write_text(chart_config(values, tmp_path / "jetstream"))
    assert '"password": $SCHEDULER_PASSWORD' in config.read_text()
    variables = {name: "secret" for name in values["container"]["env"] if name.endswith("_PASSWORD")}
    variables["TRAINYARD_NATS_ISSUER"] = issuer_public_key(new_issuer_seed())
    assert set(variables) == set(validator.server_variables())
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(config)], capture_output=True, text=True,
                           env={**os.environ, **variables}, timeout=60, check=False)
    assert check.returncode == 0, check.stderr + check.stdout
