"""Metrics as a process exports them (libs/telemetry/metrics.py): each run in a process of its own, since a process
sets its meter provider once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from devstack.stack import REPO_ROOT
from libs.telemetry.metrics import CATALOGUE
from tests.support.otlp import OtlpReceiver

# Records every metric of the catalogue once, then prints the target file it wrote and what it serves.
EXPORTER = textwrap.dedent("""
    import json, os, sys, urllib.request
    from pathlib import Path
    from libs.telemetry import metrics as m

    gauges = {metric.name: m.SampledGauge(metric) for metric in m.CATALOGUE if metric.kind == "gauge"}
    m.configure_metrics("agent-n1", service="agent", node="n1")
    for metric in m.CATALOGUE:
        values = tuple(f"v{i}" for i, _ in enumerate(metric.attributes))
        if metric.kind == "counter":
            m.counter(metric).add(2, m.attributes(metric, *values))
        elif metric.kind == "histogram":
            m.histogram(metric).record(0.02, m.attributes(metric, *values))
        else:
            gauges[metric.name].set({values: 3})
    target = json.loads(next(Path(os.environ["TRAINYARD_METRICS_TARGETS"]).glob("agent-n1-*.json")).read_text())
    served = urllib.request.urlopen(f"http://127.0.0.1:{m.served_port()}/metrics", timeout=60).read().decode()
    m.shutdown_metrics()
    left = list(Path(os.environ["TRAINYARD_METRICS_TARGETS"]).iterdir())
    print(json.dumps({"target": target, "served": served, "left": [p.name for p in left],
                      "port": m.served_port()}))
""")


def export(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", EXPORTER], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_a_process_serves_every_catalogued_metric_under_the_name_its_documentation_gives(tmp_path: Path) -> None:
    result = export({"TRAINYARD_METRICS_PORT": "0", "TRAINYARD_METRICS_TARGETS": str(tmp_path)})
    served = str(result["served"])
    for metric in CATALOGUE:
        series = metric.prometheus_name + ("_bucket" if metric.kind == "histogram" else "")
        assert f"\n{series}{{" in served, f"{metric.name} is not served as {series}"
    # Attributes become labels, dots turned into underscores.
    assert 'trainyard_jobs_queued{otel_scope_name="trainyard",otel_scope_schema_url="",otel_scope_version="",' \
           'trainyard_flavor="v1",trainyard_priority="v0"} 3.0' in served
    assert "trainyard_scheduler_admissions_total{" in served and 'trainyard_priority="v0"} 2.0' in served
    assert 'service_name="trainyard-agent"' in served  # target_info carries the resource


def test_a_process_says_where_it_serves_and_forgets_it_when_it_stops(tmp_path: Path) -> None:
    result = export({"TRAINYARD_METRICS_PORT": "0", "TRAINYARD_METRICS_TARGETS": str(tmp_path)})
    targets: list[dict[str, Any]] = result["target"]  # type: ignore[assignment]
    [target] = targets
    assert target["labels"] == {"service": "agent", "node": "n1"}
    [address] = target["targets"]
    assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
    assert result["left"] == []  # Prometheus stops looking for a process that stopped
    assert result["port"] is None


def test_without_a_port_or_otlp_nothing_is_served_and_recording_costs_nothing(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        from libs.telemetry import metrics as m
        m.configure_metrics("scheduler")
        m.counter(m.ADMISSIONS).add(1, {"trainyard.priority": "normal"})
        m.SampledGauge(m.JOBS).set({("queued",): 1})
        print(m.metrics_enabled(), m.served_port())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_METRICS")}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None"]


def test_no_metric_takes_a_job_or_a_user_as_an_attribute() -> None:
    unbounded = {"trainyard.job.id", "job_id", "trainyard.user", "enduser.id", "trainyard.node.name", "rank"}
    for metric in CATALOGUE:
        assert not set(metric.attributes) & unbounded, metric.name


def test_the_operations_guide_lists_every_metric_under_its_prometheus_name() -> None:
    guide = (REPO_ROOT / "docs" / "operations.md").read_text()
    missing = [metric.prometheus_name for metric in CATALOGUE if f"| `{metric.prometheus_name}` |" not in guide]
    assert not missing, f"docs/operations.md does not list {missing}"


def test_metrics_are_pushed_over_otlp_when_asked() -> None:
    script = textwrap.dedent("""
        from libs.telemetry import metrics as m
        m.configure_metrics("launcher")
        m.counter(m.EVENTS_RECORDED).add(1, {"trainyard.event.type": "LaunchPlanned"})
        m.shutdown_metrics()  # pushes what it holds
    """)
    with OtlpReceiver() as receiver:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_METRICS")},
               "TRAINYARD_METRICS": "otlp", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.metrics_endpoint}
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert ("trainyard-launcher", "trainyard.events.recorded") in receiver.metrics()
        assert not receiver.refused
