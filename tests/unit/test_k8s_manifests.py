"""deploy/k8s/validate.py (`make lint`): the repository's manifests pass it, offline, against Kubernetes' schemas;
a broken copy is refused, naming the file and the field. The NATS Helm values make a configuration nats-server
accepts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.servers import nats_server_binary
from devstack.stack import REPO_ROOT
from libs.natsauth import issuer_public_key, new_issuer_seed
from tests.support.scripts import load_script

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
    assert kinds.count("Deployment") == 4 and kinds.count("PodDisruptionBudget") == 4
    assert kinds.count("DaemonSet") == 1 and kinds.count("NetworkPolicy") >= 4
    assert {"PodMonitor", "PrometheusRule", "Kustomization", "HelmValues"} <= set(kinds)


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
