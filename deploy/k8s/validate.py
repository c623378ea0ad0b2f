"""Checks the Kubernetes manifests of deploy/k8s offline (`make lint`): `.venv/bin/python deploy/k8s/validate.py`.

- Every document of every `*.yaml` here (but kustomization.yaml, kustomize's own file) is validated against
  the schemas of Kubernetes KUBERNETES_VERSION that the package kubernetes-validate ships, strictly: a
  misspelt or unknown field is an error, as is a value of the wrong type or a missing required field. A
  kind without a schema is an error too, except the Prometheus Operator's PodMonitor and PrometheusRule
  (monitoring.yaml), whose structure is checked here instead.
- The pods of the Deployments and DaemonSets run as a non-root user, without privilege escalation or
  capabilities, with resource requests; the services' containers also with a read-only root file system
  and a memory limit. Every service Deployment runs two replicas or more and has a PodDisruptionBudget.
- The gateway's pods hold no credential: they act only with each caller's token (services/gateway), so they
  reference no Secret, mount no service account token and set none of the control plane's credential variables
  (nor take one from a ConfigMap). The NetworkPolicies that select them let them reach NATS (TCP 4222), DNS (UDP
  and TCP 53) and an OTLP collector (TCP 4318) only, each rule naming where, and take connections only on the
  ports their containers declare; some policy must limit each direction.
- Every file of Kubernetes objects is in kustomization.yaml, but monitoring.yaml (it needs the operator),
  database-roles.yaml (a Job run before the services, with the database administrator's Secret) and the
  examples to adapt to a cluster, `*.example.yaml` (the gateway's Ingress).
- The NATS Helm values (helm/nats-values.yaml) run a JetStream cluster of at least as many servers as the
  streams' replicas (TRAINYARD_STREAM_REPLICAS in config.yaml), with the roles of libs/natsroles.py
  (`--print-nats-merge` prints the `config.merge` block they must hold, `--write-nats-merge` writes it).

One line per document: file, kind/name and `ok` or what is wrong, at which field. The exit status is 1
when anything is wrong.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import yaml

from libs import natsauth, natsroles, settings
from libs.messaging.connection import NATS_PASSWORD_FILE_VARIABLE, NATS_PASSWORD_VARIABLE

KUBERNETES_VERSION = "1.31"
HERE = Path(__file__).resolve().parent
KUSTOMIZATION = "kustomization.yaml"
NATS_VALUES = Path("helm") / "nats-values.yaml"
# Applied on its own: monitoring.yaml needs the Prometheus Operator's CRDs (README.md, "Metrics"); the Job of
# database-roles.yaml needs the database administrator's Secret, before the services (README.md, "4. PostgreSQL").
OUTSIDE_KUSTOMIZATION = frozenset({"monitoring.yaml", "database-roles.yaml"})
# Examples to adapt to a cluster and apply by hand (gateway-ingress.example.yaml: a host name, a certificate, a
# controller of the cluster's own); checked against the schemas all the same.
EXAMPLE_SUFFIX = ".example.yaml"
COMPONENT_LABEL = "app.kubernetes.io/component"
# The components whose pods hold no credential of their own: the gateway logs in to NATS with each caller's token
# (services/gateway/connections.py) and never touches PostgreSQL.
CREDENTIAL_FREE = frozenset({"gateway"})
# What gives the power of a service, an agent or a user: none of these may reach a credential-free pod.
CREDENTIAL_VARIABLES = frozenset({
    *settings.DATABASE_VARIABLES, "TRAINYARD_AUTH_SECRET", "TRAINYARD_AUTH_SECRET_FILE", NATS_PASSWORD_VARIABLE,
    NATS_PASSWORD_FILE_VARIABLE, natsauth.ISSUER_SEED_FILE_VARIABLE, settings.NODE_TOKEN_VARIABLE,
    settings.NODE_TOKEN_FILE_VARIABLE, "TRAINYARD_TOKEN", "TRAINYARD_TOKEN_FILE"})
# Where a credential-free pod may connect: (protocol, port) -> what listens there.
CREDENTIAL_FREE_EGRESS = {("TCP", 4222): "NATS", ("UDP", 53): "DNS", ("TCP", 53): "DNS",
                          ("TCP", 4318): "an OTLP/HTTP collector"}
OPERATOR_API = "monitoring.coreos.com/v1"
DURATION = re.compile(r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$")  # a Prometheus duration: 30s, 1h30m


class Invalid(Exception):
    """A document breaks a rule: `field` says where (dotted, `[n]` for list items), `message` what."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Result:
    """What became of one document."""

    file: str
    kind: str
    name: str
    problem: str | None = None  # None: valid

    @property
    def ok(self) -> bool:
        return self.problem is None

    def line(self, widths: tuple[int, int] = (0, 0)) -> str:
        verdict = "ok" if self.problem is None else f"ERROR {self.problem}"
        return f"{self.file:<{widths[0]}}  {self.kind + '/' + self.name:<{widths[1]}}  {verdict}"


def field_path(parts: Sequence[object]) -> str:
    """`spec.template.spec.containers[0].image` from the parts of a path."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def get(document: Any, *parts: str | int) -> Any:
    """The value at a path, or None where the path leads nowhere."""
    value = document
    for part in parts:
        if isinstance(part, int):
            value = value[part] if isinstance(value, list) and -len(value) <= part < len(value) else None
        else:
            value = value.get(part) if isinstance(value, dict) else None
    return value


def require(condition: bool, parts: Sequence[str | int], message: str) -> None:
    if not condition:
        raise Invalid(field_path(parts), message)


# --- Kubernetes' schemas -----------------------------------------------------------------------------------------

def check_schema(document: Mapping[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(dict(document), version, strict=True)
    except kubernetes_validate.ValidationError as error:
        raise Invalid(field_path(list(error.path)), f"{error.message} (Kubernetes {version})") from None
    except kubernetes_validate.SchemaNotFoundError as error:
        raise Invalid("kind", f"{error.message}; only the Prometheus Operator's PodMonitor and PrometheusRule "
                              "are checked without a schema") from None


# --- The Prometheus Operator's CRDs ------------------------------------------------------------------------------

def check_keys(value: Any, parts: Sequence[str | int], allowed: AbstractSet[str],
               required: AbstractSet[str] = frozenset()) -> None:
    require(isinstance(value, dict), parts, "must be a mapping")
    unknown = sorted(set(value) - allowed)
    require(not unknown, parts, f"unknown field(s) {', '.join(unknown)}")
    missing = sorted(required - set(value))
    require(not missing, parts, f"missing required field(s) {', '.join(missing)}")


def check_string_map(value: Any, parts: Sequence[str | int]) -> None:
    require(isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()),
            parts, "must map strings to strings")


def check_operator_metadata(document: Mapping[str, Any]) -> None:
    check_keys(document, [], {"apiVersion", "kind", "metadata", "spec"}, {"apiVersion", "kind", "metadata", "spec"})
    metadata = document["metadata"]
    check_keys(metadata, ["metadata"], {"name", "namespace", "labels", "annotations"}, {"name"})
    require(isinstance(metadata["name"], str) and metadata["name"] != "", ["metadata", "name"], "must be a name")
    for key in ("labels", "annotations"):
        if key in metadata:
            check_string_map(metadata[key], ["metadata", key])


def check_pod_monitor(document: Mapping[str, Any]) -> None:
    check_operator_metadata(document)
    spec = document["spec"]
    check_keys(spec, ["spec"], {"jobLabel", "namespaceSelector", "selector", "podMetricsEndpoints", "podTargetLabels",
                                "sampleLimit", "targetLimit"}, {"selector", "podMetricsEndpoints"})
    check_keys(spec["selector"], ["spec", "selector"], {"matchLabels", "matchExpressions"})
    if "matchLabels" in spec["selector"]:
        check_string_map(spec["selector"]["matchLabels"], ["spec", "selector", "matchLabels"])
    for i, expression in enumerate(get(spec, "selector", "matchExpressions") or []):
        where: list[str | int] = ["spec", "selector", "matchExpressions", i]
        check_keys(expression, where, {"key", "operator", "values"}, {"key", "operator"})
        require(expression["operator"] in ("In", "NotIn", "Exists", "DoesNotExist"), [*where, "operator"],
                "must be In, NotIn, Exists or DoesNotExist")
    if "namespaceSelector" in spec:
        check_keys(spec["namespaceSelector"], ["spec", "namespaceSelector"], {"any", "matchNames"})
    endpoints = spec["podMetricsEndpoints"]
    require(isinstance(endpoints, list) and len(endpoints) > 0, ["spec", "podMetricsEndpoints"],
            "must list at least one endpoint")
    for i, endpoint in enumerate(endpoints):
        where = ["spec", "podMetricsEndpoints", i]
        check_keys(endpoint, where, {"port", "portNumber", "path", "interval", "scrapeTimeout", "scheme",
                                     "honorLabels", "relabelings", "metricRelabelings"})
        require("port" in endpoint or "portNumber" in endpoint, where, "needs a port (name) or portNumber")
        require(str(endpoint.get("path", "/")).startswith("/"), [*where, "path"], "must start with /")
        for key in ("interval", "scrapeTimeout"):
            if key in endpoint:
                require(isinstance(endpoint[key], str) and bool(DURATION.match(endpoint[key])), [*where, key],
                        "must be a Prometheus duration such as 15s")
        for j, relabeling in enumerate(endpoint.get("relabelings", [])):
            check_keys(relabeling, [*where, "relabelings", j], {"sourceLabels", "separator", "targetLabel", "regex",
                                                                "modulus", "replacement", "action"})


RULE_FIELDS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}


def check_prometheus_rule(document: Mapping[str, Any]) -> None:
    check_operator_metadata(document)
    spec = document["spec"]
    check_keys(spec, ["spec"], {"groups"}, {"groups"})
    groups = spec["groups"]
    require(isinstance(groups, list) and len(groups) > 0, ["spec", "groups"], "must list at least one group")
    for i, group in enumerate(groups):
        where: list[str | int] = ["spec", "groups", i]
        check_keys(group, where, {"name", "interval", "rules", "limit", "query_offset", "labels"}, {"name", "rules"})
        require(isinstance(group["rules"], list) and len(group["rules"]) > 0, [*where, "rules"], "must list rules")
        for j, rule in enumerate(group["rules"]):
            at: list[str | int] = [*where, "rules", j]
            check_keys(rule, at, RULE_FIELDS, {"expr"})
            require(("alert" in rule) != ("record" in rule), at, "needs exactly one of alert and record")
            require(isinstance(rule["expr"], str | int) and str(rule["expr"]).strip() != "", [*at, "expr"],
                    "must be a PromQL expression")
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    require(isinstance(rule[key], str) and bool(DURATION.match(rule[key])), [*at, key],
                            "must be a Prometheus duration such as 5m")
            for key in ("labels", "annotations"):
                if key in rule:
                    check_string_map(rule[key], [*at, key])


OPERATOR_CHECKS = {"PodMonitor": check_pod_monitor, "PrometheusRule": check_prometheus_rule}


# --- Trainyard's own rules ---------------------------------------------------------------------------------------

def check_pod_policy(document: Mapping[str, Any]) -> None:
    """Non-root, no privilege escalation, no capabilities, resource requests; for the services (Deployments)
    also a read-only root file system, a memory limit and two replicas. The agents (a DaemonSet) run jobs in
    their container and offer the host's resources, so they keep a writable root and have no limits."""
    kind = document["kind"]
    if kind not in ("Deployment", "DaemonSet"):
        return
    pod = ["spec", "template", "spec"]
    pod_context = get(document, *pod, "securityContext") or {}
    if kind == "Deployment":
        require((get(document, "spec", "replicas") or 1) >= 2, ["spec", "replicas"],
                "must be 2 or more: an active instance and a standby")
    for i, container in enumerate(get(document, *pod, "containers") or []):
        where: list[str | int] = [*pod, "containers", i]
        context = container.get("securityContext") or {}
        require(context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True, [*where, "securityContext"],
                "must run as non-root (runAsNonRoot: true here or in the pod's securityContext)")
        require(context.get("allowPrivilegeEscalation") is False,
                [*where, "securityContext", "allowPrivilegeEscalation"], "must be false")
        require("ALL" in (get(context, "capabilities", "drop") or []), [*where, "securityContext", "capabilities"],
                "must drop ALL")
        require(not get(context, "capabilities", "add"), [*where, "securityContext", "capabilities", "add"],
                "must add none")
        requests = get(container, "resources", "requests") or {}
        require({"cpu", "memory"} <= requests.keys(), [*where, "resources", "requests"], "must request cpu and memory")
        if kind == "Deployment":
            require(context.get("readOnlyRootFilesystem") is True,
                    [*where, "securityContext", "readOnlyRootFilesystem"], "must be true")
            require(get(container, "resources", "limits", "memory") is not None,
                    [*where, "resources", "limits", "memory"], "must be set")


def selects(selector: Any, labels: Mapping[str, str]) -> bool:
    match = get(selector, "matchLabels") or {}
    return bool(match) and all(labels.get(key) == value for key, value in match.items())


def matches(selector: Any, labels: Mapping[str, str]) -> bool:
    """Kubernetes' label selector: every pair of matchLabels and every matchExpression holds; an empty selector
    selects every pod."""
    if not all(labels.get(key) == value for key, value in (get(selector, "matchLabels") or {}).items()):
        return False
    for expression in get(selector, "matchExpressions") or []:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        present = key in labels
        if ((operator == "In" and labels.get(key) not in values)
                or (operator == "NotIn" and present and labels[key] in values)
                or (operator == "Exists" and not present) or (operator == "DoesNotExist" and present)):
            return False
    return True


# --- Pods that hold no credential (the gateway) ------------------------------------------------------------------

def workload_component(document: Mapping[str, Any]) -> str | None:
    """The component of a Deployment's or DaemonSet's pods (None for other kinds)."""
    if document.get("kind") not in ("Deployment", "DaemonSet"):
        return None
    component = get(document, "spec", "template", "metadata", "labels", COMPONENT_LABEL)
    return component if isinstance(component, str) else None


def check_no_credentials(document: Mapping[str, Any]) -> None:
    """A credential-free pod references no Secret (variables, envFrom, volumes, projections), mounts no service
    account token and sets no credential variable of the control plane."""
    component = workload_component(document)
    if component not in CREDENTIAL_FREE:
        return
    why = f"the {component} holds no credential, it acts with each caller's token"
    pod: list[str | int] = ["spec", "template", "spec"]
    require(get(document, *pod, "automountServiceAccountToken") is False, [*pod, "automountServiceAccountToken"],
            f"must be false: {why}")
    for i, volume in enumerate(get(document, *pod, "volumes") or []):
        require("secret" not in volume, [*pod, "volumes", i, "secret"], f"must mount no Secret: {why}")
        for j, source in enumerate(get(volume, "projected", "sources") or []):
            require(not {"secret", "serviceAccountToken"} & source.keys(),
                    [*pod, "volumes", i, "projected", "sources", j],
                    f"must project no Secret or service account token: {why}")
    for group in ("initContainers", "containers"):
        for i, container in enumerate(get(document, *pod, group) or []):
            where: list[str | int] = [*pod, group, i]
            for j, source in enumerate(container.get("envFrom") or []):
                require("secretRef" not in source, [*where, "envFrom", j, "secretRef"], f"must be no Secret: {why}")
            for j, variable in enumerate(container.get("env") or []):
                name = variable.get("name")
                require(name not in CREDENTIAL_VARIABLES, [*where, "env", j, "name"],
                        f"{name} is a credential of the control plane: {why}")
                require(get(variable, "valueFrom", "secretKeyRef") is None,
                        [*where, "env", j, "valueFrom", "secretKeyRef"], f"must be no Secret: {why}")


def policy_types(policy: Mapping[str, Any]) -> set[str]:
    """The directions a NetworkPolicy limits (without policyTypes: Ingress, and Egress when it has egress rules)."""
    named = get(policy, "spec", "policyTypes")
    if named is not None:
        return set(named)
    return {"Ingress", *(["Egress"] if get(policy, "spec", "egress") is not None else [])}


def check_credential_free_policy(policy: Mapping[str, Any], component: str, declared: AbstractSet[int | str]) -> None:
    """A NetworkPolicy selecting a credential-free pod lets it out to CREDENTIAL_FREE_EGRESS alone, each rule naming
    its ports and where, and lets in only on the ports its containers declare."""
    types = policy_types(policy)
    reachable: dict[str, list[str]] = {}
    for (protocol, port), what in CREDENTIAL_FREE_EGRESS.items():
        reachable.setdefault(what, []).append(f"{protocol} {port}")
    allowed = ", ".join(f"{what} ({' or '.join(ports)})" for what, ports in reachable.items())
    for i, rule in enumerate((get(policy, "spec", "egress") or []) if "Egress" in types else []):
        where: list[str | int] = ["spec", "egress", i]
        ports = rule.get("ports") or []
        require(bool(ports), where, f"must name its ports: without, it opens every port to the {component}")
        for j, port in enumerate(ports):
            protocol = port.get("protocol", "TCP")
            require((protocol, port.get("port")) in CREDENTIAL_FREE_EGRESS and port.get("endPort") is None,
                    [*where, "ports", j], f"{protocol} {port.get('port')}: the {component} may reach {allowed} only")
        require(bool(rule.get("to")), [*where, "to"], f"must name where the {component} may connect")
    for i, rule in enumerate((get(policy, "spec", "ingress") or []) if "Ingress" in types else []):
        where = ["spec", "ingress", i]
        ports = rule.get("ports") or []
        require(bool(ports), where, f"must name its ports: without, it opens every port of the {component}")
        for j, port in enumerate(ports):
            require(port.get("port") in declared and port.get("endPort") is None, [*where, "ports", j],
                    f"{port.get('port')}: the {component}'s containers declare no such port")


def check_credential_free_pods(documents: Sequence[tuple[str, Mapping[str, Any]]]) -> Iterator[Result]:
    """A problem of each credential-free workload that only the other documents show: a ConfigMap it takes its
    environment from holds a credential variable, no NetworkPolicy limits a direction, or one lets too much."""
    config_maps = {get(document, "metadata", "name"): document for _, document in documents
                   if document.get("kind") == "ConfigMap"}
    policies = [(file, document) for file, document in documents if document.get("kind") == "NetworkPolicy"]
    for file, document in documents:
        component = workload_component(document)
        if component not in CREDENTIAL_FREE:
            continue
        kind, name = str(document["kind"]), str(document["metadata"]["name"])
        containers = [container for group in ("initContainers", "containers")
                      for container in get(document, "spec", "template", "spec", group) or []]
        for source in (source for container in containers for source in container.get("envFrom") or []):
            config_map = get(source, "configMapRef", "name")
            held = sorted(CREDENTIAL_VARIABLES & set(get(config_maps.get(config_map), "data") or {}))
            if held:
                yield Result(file, kind, name, f"its environment comes from ConfigMap {config_map}, which holds "
                                               f"{', '.join(held)}: the {component} must get no credential")
        labels = get(document, "spec", "template", "metadata", "labels") or {}
        declared = {port.get(key) for container in containers for port in container.get("ports") or []
                    for key in ("containerPort", "name") if port.get(key) is not None}
        selecting = [(at, policy) for at, policy in policies if matches(get(policy, "spec", "podSelector"), labels)]
        for direction in ("Ingress", "Egress"):
            if not any(direction in policy_types(policy) for _, policy in selecting):
                yield Result(file, kind, name, f"no NetworkPolicy limits its pods' {direction.lower()}")
        for at, policy in selecting:
            try:
                check_credential_free_policy(policy, component, declared)
            except Invalid as problem:
                yield Result(at, "NetworkPolicy", str(get(policy, "metadata", "name")),
                             f"{problem} (it selects the pods of {kind} {name})")


def check_disruption_budgets(documents: Sequence[tuple[str, Mapping[str, Any]]]) -> Iterator[tuple[str, str]]:
    """(file, name) of every service Deployment no PodDisruptionBudget covers."""
    budgets = [document for _, document in documents if document.get("kind") == "PodDisruptionBudget"]
    for file, document in documents:
        if document.get("kind") != "Deployment":
            continue
        labels = get(document, "spec", "template", "metadata", "labels") or {}
        if not any(selects(get(budget, "spec", "selector"), labels) for budget in budgets):
            yield file, str(document["metadata"]["name"])


# --- The NATS Helm values ----------------------------------------------------------------------------------------

def nats_merge() -> dict[str, Any]:
    """The `config.merge` of the NATS chart's values: the authorization block of deploy/nats/nats-server.conf
    (libs/natsroles.py) in the chart's form, where `<< $VARIABLE >>` becomes an unquoted variable."""
    credentials = natsroles.placeholder_credentials()
    users = []
    for name, permissions in natsroles.roles(()).items():
        block: dict[str, Any] = {}
        for half, allow, deny in (("publish", permissions.publish_allow, permissions.publish_deny),
                                  ("subscribe", permissions.subscribe_allow, permissions.subscribe_deny)):
            block[half] = {"allow": list(allow), **({"deny": list(deny)} if deny else {})}
        users.append({"user": name, "password": f"<< {credentials[name]} >>", "permissions": block})
    return {"authorization": {"users": users,
                              "auth_callout": {"issuer": f"<< {natsroles.ISSUER_VARIABLE} >>",
                                               "auth_users": list(natsroles.SERVICES)}}}


def server_variables() -> list[str]:
    """The environment variables the NATS server reads its secrets from."""
    return [str(value)[1:] for value in natsroles.placeholder_credentials().values()] + [natsroles.ISSUER_VARIABLE[1:]]


def first_difference(actual: Any, expected: Any, parts: list[str | int]) -> list[str | int] | None:
    """Where `actual` first differs from `expected`: the path of the innermost mapping, or list of mappings
    as long as the expected one, that holds the difference; None where they are equal."""
    if isinstance(actual, dict) and isinstance(expected, dict):
        for key in [*expected, *(key for key in actual if key not in expected)]:
            if (found := first_difference(actual.get(key), expected.get(key), [*parts, key])) is not None:
                return found
        return None
    if (isinstance(actual, list) and isinstance(expected, list) and len(actual) == len(expected)
            and all(isinstance(item, dict) for item in expected)):
        for i, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
            if (found := first_difference(mine, theirs, [*parts, i])) is not None:
                return found
        return None
    return None if actual == expected else parts


def check_nats_values(values: Any, stream_replicas: int) -> None:
    require(isinstance(values, dict), [], "must be a mapping")
    require(get(values, "config", "cluster", "enabled") is True, ["config", "cluster", "enabled"], "must be true")
    servers = get(values, "config", "cluster", "replicas")
    require(isinstance(servers, int) and servers >= max(3, stream_replicas), ["config", "cluster", "replicas"],
            f"must be 3 or more, and at least TRAINYARD_STREAM_REPLICAS ({stream_replicas})")
    require(get(values, "config", "jetstream", "enabled") is True, ["config", "jetstream", "enabled"], "must be true")
    require(get(values, "config", "jetstream", "fileStore", "pvc", "size") is not None,
            ["config", "jetstream", "fileStore", "pvc", "size"], "must size the JetStream volume")
    require(get(values, "config", "jetstream", "merge", "sync_interval") == "always",
            ["config", "jetstream", "merge", "sync_interval"], "must be always, as in deploy/nats/nats-server.conf")
    expected = nats_merge()
    merge = get(values, "config", "merge") or {}
    differs = first_difference({key: merge.get(key) for key in expected}, expected, ["config", "merge"])
    require(differs is None, differs or [], "differs from the roles of libs/natsroles.py; replace config.merge with "
                                            "the output of deploy/k8s/validate.py --print-nats-merge (make schemas)")
    env = get(values, "container", "env") or {}
    for variable in server_variables():
        require(get(env, variable, "valueFrom", "secretKeyRef", "key") is not None, ["container", "env", variable],
                "must come from a Secret (valueFrom.secretKeyRef)")


def stream_replicas(documents: Sequence[tuple[str, Mapping[str, Any]]]) -> int:
    for _, document in documents:
        if document.get("kind") == "ConfigMap" and get(document, "metadata", "name") == "trainyard-env":
            return int(get(document, "data", "TRAINYARD_STREAM_REPLICAS") or 1)
    return 1


# --- Putting it together -----------------------------------------------------------------------------------------

def shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def check_document(document: Any, version: str) -> None:
    require(isinstance(document, dict), [], "must be a mapping (a Kubernetes object)")
    for key in ("apiVersion", "kind"):
        require(isinstance(document.get(key), str), [key], "missing")
    check = OPERATOR_CHECKS.get(document["kind"]) if document["apiVersion"] == OPERATOR_API else None
    if check is not None:
        check(document)
    else:
        check_schema(document, version)
        check_pod_policy(document)
        check_no_credentials(document)


def load_documents(path: Path) -> list[Any]:
    with path.open() as stream:
        return [document for document in yaml.safe_load_all(stream) if document is not None]


def validate_directory(directory: Path = HERE, version: str = KUBERNETES_VERSION) -> list[Result]:
    """Every document of every manifest in `directory`, then the files' own rules; a Result each."""
    results: list[Result] = []
    valid: list[tuple[str, Mapping[str, Any]]] = []
    manifests = sorted(path for path in directory.glob("*.yaml") if path.name != KUSTOMIZATION)
    for path in manifests:
        file = shown(path)
        try:
            documents = load_documents(path)
        except yaml.YAMLError as error:
            results.append(Result(file, "-", "-", f"not YAML: {error}".replace("\n", " ")))
            continue
        for document in documents:
            kind = str(get(document, "kind") or "-")
            name = str(get(document, "metadata", "name") or "-")
            try:
                check_document(document, version)
            except Invalid as problem:
                results.append(Result(file, kind, name, str(problem)))
            else:
                results.append(Result(file, kind, name))
                valid.append((file, document))
    for file, name in check_disruption_budgets(valid):
        results.append(Result(file, "Deployment", name, "no PodDisruptionBudget selects its pods (pdb.yaml)"))
    results.extend(check_credential_free_pods(valid))
    results.append(check_kustomization(directory, manifests))
    results.append(check_values_file(directory / NATS_VALUES, stream_replicas(valid)))
    return results


def check_kustomization(directory: Path, manifests: Sequence[Path]) -> Result:
    """kustomization.yaml lists every file of Kubernetes objects, but those applied on their own and examples."""
    path = directory / KUSTOMIZATION
    try:
        [kustomization] = load_documents(path)
    except (OSError, yaml.YAMLError, ValueError) as error:
        return Result(shown(path), "Kustomization", "-", f"cannot be read: {error}".replace("\n", " "))
    listed = get(kustomization, "resources") or []
    missing = [p.name for p in manifests if p.name not in listed and p.name not in OUTSIDE_KUSTOMIZATION
               and not p.name.endswith(EXAMPLE_SUFFIX)]
    return Result(shown(path), "Kustomization", "-", f"resources: {', '.join(missing)} missing" if missing else None)


def check_values_file(path: Path, replicas: int) -> Result:
    try:
        [values] = load_documents(path)
    except (OSError, yaml.YAMLError, ValueError) as error:
        return Result(shown(path), "HelmValues", "nats", f"cannot be read: {error}".replace("\n", " "))
    try:
        check_nats_values(values, replicas)
    except Invalid as problem:
        return Result(shown(path), "HelmValues", "nats", str(problem))
    return Result(shown(path), "HelmValues", "nats")


def merge_block() -> str:
    """The `config.merge` block the NATS Helm values must hold, as YAML under `config:`."""
    return yaml.safe_dump({"config": {"merge": nats_merge()}}, sort_keys=False, width=120)


def with_merge_block(values: str) -> str:
    """`values` (helm/nats-values.yaml) with its `config.merge` block (the one holding `authorization`) made anew,
    everything else, comments included, as it was."""
    lines = values.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines[:-1])
                 if line == "  merge:\n" and lines[i + 1] == "    authorization:\n")
    end = start + 1
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():  # the blank lines after the block stay
        end -= 1
    block = merge_block().splitlines(keepends=True)[1:]  # without its `config:` line
    return "".join(lines[:start] + block + lines[end:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("directory", nargs="?", type=Path, default=HERE, help="the manifests (default: deploy/k8s)")
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION, help="the schemas to validate against")
    parser.add_argument("--print-nats-merge", action="store_true",
                        help="print the config.merge block of helm/nats-values.yaml and exit")
    parser.add_argument("--write-nats-merge", action="store_true",
                        help="write the config.merge block into helm/nats-values.yaml and exit")
    arguments = parser.parse_args(argv)
    if arguments.print_nats_merge:
        print(merge_block(), end="")
        return 0
    if arguments.write_nats_merge:
        values = HERE / "helm" / "nats-values.yaml"
        values.write_text(with_merge_block(values.read_text()))
        return 0
    results = validate_directory(arguments.directory, arguments.kubernetes_version)
    widths = (max(len(r.file) for r in results), max(len(r.kind) + 1 + len(r.name) for r in results))
    for result in results:
        print(result.line(widths))
    failed = [result for result in results if not result.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} checks failed (Kubernetes {arguments.kubernetes_version} schemas, "
              f"kubernetes-validate {kubernetes_validate.__version__})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
