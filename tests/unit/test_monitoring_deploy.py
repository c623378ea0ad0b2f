"""The monitoring files of deploy/: Prometheus' configurations and alerting rules (checked and unit-tested with
promtool when it is installed), the Grafana dashboard, and the Kubernetes manifests' metrics settings. Every metric
they name must be one Trainyard records (libs/telemetry/metrics.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.stack import REPO_ROOT
from libs.telemetry.metrics import CATALOGUE

PROMETHEUS = REPO_ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
K8S = REPO_ROOT / "deploy" / "k8s"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "trainyard.json"
WORKLOADS = ("scheduler", "launcher", "monitor", "autoscaler", "gateway", "agent")
METRICS_PORT = 9464

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian's 'prometheus' package; "
                             "deploy/local/system-packages.sh installs it where apt-get may be used)")


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120, check=False)


def documents(path: Path) -> list[Any]:
    with path.open() as stream:
        return [document for document in yaml.safe_load_all(stream) if document is not None]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [document for path in sorted(K8S.glob("*.yaml")) for document in documents(path)
                                   if document.get("kind") == kind and document["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in documents(ALERTS)[0]["groups"] for rule in group["rules"]]


def dashboard_panels() -> Iterator[dict[str, Any]]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]


# --- promtool ---------------------------------------------------------------------------------------------------

@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    checked = promtool("check", "rules", ALERTS)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs_promtool
def test_alert_rules_pass_their_unit_tests() -> None:
    tested = promtool("test", "rules", PROMETHEUS / "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


@needs_promtool
def test_local_stack_configuration_renders_to_a_valid_one(tmp_path: Path) -> None:
    # As the stack's starter renders it, with a target file as a process writes it.
    metrics = tmp_path / "home with space" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "agent-node-a.json").write_text(json.dumps(
        [{"targets": ["127.0.0.1:41234"], "labels": {"service": "agent", "node": "node-a"}}]))
    template = (PROMETHEUS / "prometheus.yml.in").read_text()
    assert "@METRICS_DIR@" in template and "@RULES@" in template
    config = tmp_path / "prometheus.yml"
    config.write_text(template.replace("@METRICS_DIR@", str(metrics)).replace("@RULES@", str(ALERTS)))

    checked = promtool("check", "config", config)

    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "WARNING" not in checked.stdout + checked.stderr, checked.stdout + checked.stderr
    rendered = yaml.safe_load(config.read_text())
    assert rendered["global"]["scrape_interval"] == "5s"
    assert rendered["rule_files"] == [str(ALERTS)]
    [job] = rendered["scrape_configs"]
    assert job["job_name"] == "trainyard"
    assert job["file_sd_configs"] == [{"files": [f"{metrics}/*.json"], "refresh_interval": "5s"}]


@needs_promtool
def test_kubernetes_scrape_configuration_is_valid() -> None:
    checked = promtool("check", "config", PROMETHEUS / "kubernetes.yml")
    if "kubernetes_sd_configs not found" in checked.stderr + checked.stdout:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's is)")
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs_promtool
def test_dashboard_expressions_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses each as a recording rule, with Grafana's variables given values.
    rules = [{"record": f"dashboard:query_{i}:", "expr": expr.replace("$__rate_interval", "1m").replace("$job", "x")}
             for i, expr in enumerate(dashboard_expressions())]
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = promtool("check", "rules", path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- metric names -----------------------------------------------------------------------------------------------

# What PromQL names besides metrics: functions (followed by "("), keywords, and what the stripping below removes.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
            "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: what is left once strings, label matchers, ranges, label lists
    (by, on, ...) and function calls' names are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set(re.findall(r"(?<![\w.$:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text))
    return {name for name in names if name.lower() not in KEYWORDS}


def catalogued() -> set[str]:
    names = {"up"}
    for metric in CATALOGUE:
        name = metric.prometheus_name
        names |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"} if metric.kind == "histogram" else {name}
    return names


def test_metric_names_parse_out_of_expressions() -> None:
    expr = ('sum by (trainyard_priority) (rate(trainyard_scheduler_admissions_total{job="$job", '
            'trainyard_flavor=~"a|b"}[$__rate_interval])) unless on (job, instance) '
            '(trainyard_service_active == 0) or vector(0) > bool 0.05 and '
            'histogram_quantile(0.99, sum by (le) (rate(messaging_process_duration_seconds_bucket[5m])))')
    assert metric_names(expr) == {"trainyard_scheduler_admissions_total", "trainyard_service_active",
                                  "messaging_process_duration_seconds_bucket"}


@pytest.mark.parametrize("source", ["alerts.yml", "monitoring.yaml", "trainyard.json"])
def test_every_metric_named_is_catalogued(source: str) -> None:
    if source == "alerts.yml":
        expressions = [rule["expr"] for rule in alert_rules()]
    elif source == "monitoring.yaml":
        rule = k8s_object("PrometheusRule", "trainyard")
        expressions = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    else:
        expressions = dashboard_expressions()
    assert expressions
    named = set().union(*map(metric_names, expressions))
    prefixed = {name for expr in expressions for name in re.findall(r"\b(?:trainyard|messaging)_\w+", expr)}

    assert named - catalogued() == set()
    assert named >= {"trainyard_service_active"}
    # The names with Trainyard's prefixes that are not metrics are labels (attributes with dots as underscores).
    labels = {attribute.replace(".", "_") for metric in CATALOGUE for attribute in metric.attributes}
    assert prefixed - catalogued() - labels == set()


# --- alerting rules ---------------------------------------------------------------------------------------------

def test_alert_rules_say_how_bad_and_what() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    assert {"OutboxRelayStuck", "FollowerStuck", "NoSchedulerLeader", "NodesLost", "ServiceDown", "NodesUnhealthy",
            "RequestErrors"} <= set(names)
    for rule in rules:
        assert rule.get("for"), rule["alert"]
        assert rule["labels"]["severity"] in {"page", "ticket"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    pages = {rule["alert"] for rule in rules if rule["labels"]["severity"] == "page"}
    assert pages == {"OutboxRelayStuck", "FollowerStuck", "NoSchedulerLeader", "NodesLost"}
    # Each page-level rule has a unit test that expects it to fire.
    tests = documents(PROMETHEUS / "alerts_test.yml")[0]["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert pages <= fired


def test_kubernetes_prometheus_rule_carries_the_alert_rules() -> None:
    rule = k8s_object("PrometheusRule", "trainyard")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "trainyard"
    assert rule["spec"] == documents(ALERTS)[0]


# --- Kubernetes -------------------------------------------------------------------------------------------------

def test_kubernetes_manifests_are_valid_yaml() -> None:
    for path in sorted(K8S.glob("*.yaml")):
        for document in documents(path):
            assert {"apiVersion", "kind"} <= document.keys(), path


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_pod_serves_metrics_and_is_scraped(workload: str) -> None:
    kind = "DaemonSet" if workload == "agent" else "Deployment"
    template = k8s_object(kind, f"trainyard-{workload}")["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT), "prometheus.io/path": "/metrics"}
    [container] = template["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["TRAINYARD_METRICS_PORT"] == str(METRICS_PORT)
    assert env["TRAINYARD_METRICS_ADDRESS"] == "0.0.0.0"
    assert {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"} in container["ports"]

    # The PodMonitor picks the pod by its labels, on that port, and labels it as the rules expect.
    monitor = k8s_object("PodMonitor", "trainyard")["spec"]
    labels = template["metadata"]["labels"]
    assert monitor["namespaceSelector"]["matchNames"] == ["trainyard"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    for expression in monitor["selector"].get("matchExpressions", []):
        assert expression["operator"] == "In"
        assert labels[expression["key"]] in expression["values"]
    assert labels[monitor["jobLabel"]] == "trainyard"  # job="trainyard"
    [endpoint] = monitor["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert {relabel["targetLabel"] for relabel in endpoint["relabelings"]} >= {"service", "node"}


def test_monitoring_manifest_is_left_out_of_the_kustomization() -> None:
    # It needs the Prometheus Operator's CRDs: `kubectl apply -k` must work without them.
    [kustomization] = documents(K8S / "kustomization.yaml")
    assert "monitoring.yaml" not in kustomization["resources"]
    assert all((K8S / resource).exists() for resource in kustomization["resources"])


# --- Grafana ----------------------------------------------------------------------------------------------------

def test_dashboard_queries_prometheus_through_its_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(dashboard_panels())
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    rows = {panel["title"] for panel in panels if panel["type"] == "row"}
    assert {"Queue", "Throughput", "Latency", "Nodes", "Alerts", "Relay and followers", "Autoscaler"} <= rows
    assert any(panel["type"] == "alertlist" for panel in panels)
    for panel in panels:
        for target in panel.get("targets", []):
            assert panel["datasource"] == target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert target["expr"].strip(), panel["title"]
