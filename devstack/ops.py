"""Metrics of a local stack: where its processes say they serve, and a Prometheus that scrapes them (`make up OPS=1`).

Every process of the stack serves its metrics on a port of its own choosing and writes where into
`<home>/metrics/` (libs/telemetry/metrics.py); Prometheus, from Debian's `prometheus` package, finds them there
(file service discovery) with the configuration and alerting rules in `deploy/prometheus/`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from devstack.servers import ServerError, wait_for_port
from devstack.stack import REPO_ROOT, ProcessSet

PROMETHEUS_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml.in"
ALERT_RULES = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"


def metrics_env(home: Path) -> dict[str, str]:
    """The variables that make every process of the stack serve its metrics and say where (old targets removed)."""
    targets = home / "metrics"
    shutil.rmtree(targets, ignore_errors=True)
    targets.mkdir(parents=True)
    return {"TRAINYARD_METRICS_PORT": "0", "TRAINYARD_METRICS_TARGETS": str(targets)}


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or next((str(p) for p in (Path("/usr/bin/prometheus"),) if p.exists()), None)


def render_config(home: Path) -> Path:
    """Prometheus' configuration for the stack under `home`, written beside its data."""
    folder = home / "prometheus"
    folder.mkdir(parents=True, exist_ok=True)
    text = PROMETHEUS_CONFIG.read_text().replace("@METRICS_DIR@", str(home / "metrics")).replace(
        "@RULES@", str(ALERT_RULES))
    config = folder / "prometheus.yml"
    config.write_text(text)
    return config


def start_prometheus(processes: ProcessSet, port: int) -> str:
    """Start Prometheus on 127.0.0.1:`port`, scraping the stack of `processes` (stopped with it); its address."""
    binary = prometheus_binary()
    if binary is None:
        raise ServerError("Prometheus is not installed: `apt-get install prometheus` (Debian), or run without OPS=1")
    home = processes.home
    config = render_config(home)
    processes.start("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'prometheus'}/data",
                                   f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=7d"])
    wait_for_port(port, 30, "prometheus", home / "logs" / "prometheus.log")
    return f"http://127.0.0.1:{port}"
