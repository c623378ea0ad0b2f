"""The Python environment is the lock, and the lock is what pyproject.toml asks for (`make install`, `make lint`).

    .venv/bin/python deploy/lock/verify.py

Three checks, each naming what to do when it fails:
- every package installed in this environment (but the project itself) is pinned in dev.txt at the version
  installed, and every pinned one is installed;
- dev.txt holds exactly the packages that pyproject.toml's dependencies, its `dev` and `jobs` extras and its
  build requirements need, directly or through each other, each within the range asked for;
- runtime.txt holds exactly what the dependencies and the build requirements need, at dev.txt's versions.

The requirements of each pinned package are read from its installed metadata, so the check needs no network:
a lock compiled against a changed pyproject.toml is found stale here, in CI, before anything runs.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK_DIR = Path(__file__).resolve().parent
PYPROJECT = LOCK_DIR.parents[1] / "pyproject.toml"
DEV_EXTRAS = ("dev", "jobs")
RELOCK = "run `make lock` to compile deploy/lock/ anew from pyproject.toml, then `make test`"
REINSTALL = "run `make install` (it builds .venv anew from deploy/lock/dev.txt)"

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def read_pins(lock: Path) -> dict[str, str]:
    """Every `name==version` of a pip-compile lock file, by canonical name."""
    pins: dict[str, str] = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        if match := _PIN.match(line):
            pins[canonicalize_name(match[1])] = match[2]
    return pins


@dataclass(frozen=True)
class Roots:
    """What pyproject.toml asks for: the runtime's requirements, and the development environment's."""

    runtime: tuple[Requirement, ...]
    dev: tuple[Requirement, ...]


def read_roots(pyproject: Path = PYPROJECT) -> Roots:
    document = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = document["project"]
    build = [Requirement(line) for line in document.get("build-system", {}).get("requires", [])]
    runtime = [Requirement(line) for line in project.get("dependencies", [])] + build
    extras = project.get("optional-dependencies", {})
    dev = runtime + [Requirement(line) for extra in DEV_EXTRAS for line in extras.get(extra, [])]
    return Roots(tuple(runtime), tuple(dev))


def _applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    """Whether a requirement's marker holds here, for a package installed with `extras`."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras))


def installed_requirements(name: str, extras: Iterable[str]) -> list[Requirement]:
    """What the installed package `name`, with `extras`, requires on this machine."""
    requirements = [Requirement(line) for line in metadata.requires(name) or []]
    return [requirement for requirement in requirements if _applies(requirement, extras)]


def closure_problems(roots: Iterable[Requirement], pins: Mapping[str, str], lock_name: str,
                     requires: Callable[[str, Iterable[str]], list[Requirement]] = installed_requirements,
                     ) -> list[str]:
    """How `pins` differ from the packages `roots` need, each requirement followed through `requires`."""
    problems: list[str] = []
    needed: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    queue: list[tuple[Requirement, str]] = [(root, "pyproject.toml") for root in roots if _applies(root, ())]
    while queue:
        requirement, wanted_by = queue.pop()
        name = canonicalize_name(requirement.name)
        needed.add(name)
        if name not in pins:
            problems.append(f"{wanted_by} asks for {requirement}, which {lock_name} does not pin")
            continue
        if not requirement.specifier.contains(Version(pins[name]), prereleases=True):
            problems.append(f"{wanted_by} asks for {requirement}, but {lock_name} pins {name}=={pins[name]}")
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        queue.extend((child, name) for child in requires(name, requirement.extras))
    problems.extend(f"{lock_name} pins {name}=={pins[name]}, which nothing in pyproject.toml needs"
                    for name in sorted(set(pins) - needed))
    return problems


def environment_problems(pins: Mapping[str, str], project: str = "trainyard") -> list[str]:
    """How this environment's installed packages differ from dev.txt's pins."""
    installed: dict[str, str] = {canonicalize_name(dist.metadata["Name"]): dist.version
                                 for dist in metadata.distributions()}
    installed.pop(canonicalize_name(project), None)
    problems = [f"{name} {installed[name]} is installed, but dev.txt does not pin it"
                for name in sorted(set(installed) - set(pins))]
    problems += [f"{name}=={pins[name]} is pinned in dev.txt, but not installed"
                 for name in sorted(set(pins) - set(installed))]
    problems += [f"{name} {installed[name]} is installed, but dev.txt pins {pins[name]}"
                 for name in sorted(set(pins) & set(installed)) if installed[name] != pins[name]]
    return problems


def main() -> int:
    dev = read_pins(LOCK_DIR / "dev.txt")
    runtime = read_pins(LOCK_DIR / "runtime.txt")
    roots = read_roots()
    environment = environment_problems(dev)
    if environment:
        # The lock's own checks read the installed metadata: they mean nothing until the two agree.
        print("This environment differs from deploy/lock/dev.txt:", *environment, f"To fix it, {REINSTALL}.",
              sep="\n  ", file=sys.stderr)
        return 1
    locks = closure_problems(roots.dev, dev, "dev.txt") + closure_problems(roots.runtime, runtime, "runtime.txt")
    locks += [f"runtime.txt pins {name}=={version}, dev.txt {name}=={dev[name]}"
              for name, version in sorted(runtime.items()) if dev.get(name, version) != version]
    if locks:
        print("deploy/lock/ does not match pyproject.toml:", *locks, f"To fix it, {RELOCK}.",
              sep="\n  ", file=sys.stderr)
        return 1
    print(f"deploy/lock/: {len(dev)} packages installed as pinned; the locks match pyproject.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
