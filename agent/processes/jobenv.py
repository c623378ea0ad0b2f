"""A job process's environment (SPEC L1): built from an allow-list, never inherited from the agent.

The agent runs with the platform's settings in its environment: DATABASE_URL, NATS_URL, the token
signing secret (TRAINYARD_AUTH_SECRET or …_FILE), token files and every other TRAINYARD_* setting.
None of them reaches a job. A job gets, later entries winning:

1. from the agent's environment, only what any process needs (`BASIC_VARIABLES`, LC_*) and the boards
   the node lets jobs see (CUDA_VISIBLE_DEVICES); the interface that holds the node's address, for the
   communication libraries (`network_env`: Gloo, NCCL, TensorPipe, OpenMPI);
2. the plan's env (the spec's env, checkpoint variables, the mode's variables);
3. PATH: the agent's interpreter directory first, then the agent's PATH;
4. NATS_URL (without user or password) and the job's own token (TRAINYARD_JOB_TOKEN: exec on its own
   nodes, nothing else) only when the plan names Trainyard's MPI remote shell,
   which reaches the other nodes' agents over NATS (agent/rsh.py);
5. the platform's own job variables (TRAINYARD_JOB_ID, TRAINYARD_RANK, ...).

A job that runs in an image (J10) gets the image's own environment between 1 and 2, without the agent's
host paths (HOST_PATH_VARIABLES), and the image's PATH instead of 3.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# What a process expects to find whatever it runs: the user, locale, time zone, terminal, shared
# libraries (mpirun's `-x LD_LIBRARY_PATH`) and the agent's Python environment (its interpreter runs
# jobs' `python3`, and `python3 -m agent.lifecycle` must find the agent's code).
BASIC_VARIABLES = frozenset({
    "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH",
    "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONIOENCODING",
    # Which boards the node lets jobs see: none on a CPU-only instance (A4).
    "CUDA_VISIBLE_DEVICES",
})
BASIC_PREFIXES = ("LC_",)
# Basic variables that name the agent's host paths: meaningless inside an image, which has its own.
HOST_PATH_VARIABLES = frozenset({"LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"})
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The plan's variable that points OpenMPI at a remote shell; Trainyard's is `python3 -m agent.rsh`.
REMOTE_SHELL_VARIABLE = "OMPI_MCA_plm_rsh_agent"
REMOTE_SHELL_MODULE = "agent.rsh"


def is_basic(name: str) -> bool:
    return name in BASIC_VARIABLES or name.startswith(BASIC_PREFIXES)


def uses_agent_remote_shell(plan_env: Mapping[str, str]) -> bool:
    return plan_env.get(REMOTE_SHELL_VARIABLE, "").split()[-1:] == [REMOTE_SHELL_MODULE]


JOB_TOKEN_VARIABLE = "TRAINYARD_JOB_TOKEN"


def without_credentials(urls: str) -> str:
    """The addresses alone (one, or several separated by commas): a user name or password stays with
    the agent."""
    return ",".join(_address(url.strip()) for url in urls.split(","))


def _address(url: str) -> str:
    parts = urlsplit(url)
    if parts.hostname is None or "@" not in parts.netloc:
        return url
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def passed_on(agent_env: Mapping[str, str]) -> dict[str, str]:
    """What of the agent's environment jobs may take: the basic variables, and its PATH (after the
    interpreter's directory)."""
    return {name: value for name, value in agent_env.items() if is_basic(name) or name == "PATH"}


# What tells the communication libraries which interface to use between nodes: they otherwise take the address the
# host's name resolves to, which on many hosts (Debian's /etc/hosts) is a loopback address no other node reaches.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include",
                       "OMPI_MCA_oob_tcp_if_include")


def network_env(address: str, interfaces: Mapping[str, list[str]]) -> dict[str, str]:
    """The variables naming the interface that holds the node's `address` (`interfaces`: name -> its addresses),
    so that ranks on other nodes reach it there; none when the address is a loopback one (every rank on this one
    host) or on no interface (a name, or an address NAT maps to this host)."""
    if address.startswith("127.") or address in ("::1", "localhost"):
        return {}
    holding = next((name for name, addresses in interfaces.items() if address in addresses), None)
    return {variable: holding for variable in INTERFACE_VARIABLES} if holding else {}


def job_environment(agent_env: Mapping[str, str], plan_env: Mapping[str, str], platform: Mapping[str, str], *,
                    python_dir: Path, nats_url: str, job_token: str | None = None,
                    network: Mapping[str, str] | None = None,
                    image_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one job process; `plan_env` is already translated to the workspace; `network` names the
    node's interface for the communication libraries (`network_env`; the spec's env may set them otherwise).
    `image_env`: the environment of the image the job runs in (J10), under the job's own; its PATH is the job's
    (unless the spec sets one), and the agent's host paths (its Python, its libraries) are not passed on."""
    env = {name: value for name, value in agent_env.items()
           if is_basic(name) and (image_env is None or name not in HOST_PATH_VARIABLES)}
    env.update(image_env or {})
    env.update(network or {})
    env.update(plan_env)
    if image_env is not None:
        env["PATH"] = plan_env.get("PATH") or image_env.get("PATH") or DEFAULT_PATH
    else:  # jobs find the same Python (and its packages) the agent runs on, first on PATH
        env["PATH"] = f"{python_dir}{os.pathsep}{agent_env.get('PATH', '')}"
    if uses_agent_remote_shell(plan_env):
        env["NATS_URL"] = without_credentials(nats_url)
        if job_token:  # the job's own login: exec on its own nodes, nothing else (libs/auth.py)
            env[JOB_TOKEN_VARIABLE] = job_token
    env.update(platform)
    return env
