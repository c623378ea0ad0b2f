"""deploy/lock/: the environment is the lock, and the lock is what pyproject.toml asks for (deploy/lock/verify.py,
run by `make install` and `make lint`). A dependency added, dropped or narrowed in pyproject.toml without
`make lock` is found stale, naming the package and what to run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import pytest
from packaging.requirements import Requirement

from devstack.stack import REPO_ROOT
from tests.support.scripts import load_script

verify = load_script(REPO_ROOT / "deploy" / "lock" / "verify.py", "trainyard_lock_verify")
LOCKS = REPO_ROOT / "deploy" / "lock"


def graph(edges: Mapping[str, list[str]]) -> Callable[[str, Iterable[str]], list[Requirement]]:
    """A `requires` function over a made-up package graph: each package's requirement lines."""

    def requires(name: str, extras: Iterable[str]) -> list[Requirement]:
        lines = [Requirement(line) for line in edges.get(name, [])]
        return [line for line in lines if line.marker is None
                or any(line.marker.evaluate({"extra": extra}) for extra in ("", *extras))]

    return requires


def problems(roots: list[str], pins: dict[str, str], edges: Mapping[str, list[str]]) -> list[str]:
    found: list[str] = verify.closure_problems([Requirement(root) for root in roots], pins, "dev.txt", graph(edges))
    return found


def test_the_committed_locks_match_pyproject_and_this_environment() -> None:
    dev, runtime = verify.read_pins(LOCKS / "dev.txt"), verify.read_pins(LOCKS / "runtime.txt")
    roots = verify.read_roots()
    assert verify.environment_problems(dev) == []
    assert verify.closure_problems(roots.dev, dev, "dev.txt") == []
    assert verify.closure_problems(roots.runtime, runtime, "runtime.txt") == []
    assert set(runtime) < set(dev)
    assert all(dev[name] == version for name, version in runtime.items())


def test_every_pin_is_exact_and_hashed() -> None:
    for lock in ("dev.txt", "runtime.txt"):
        text = (LOCKS / lock).read_text(encoding="utf-8")
        entries = [entry for entry in text.split("\n") if entry and not entry.startswith((" ", "#"))]
        assert entries, lock
        for entry in entries:
            assert "==" in entry and entry.endswith("\\"), f"{lock}: {entry} is not pinned with a hash"


def test_a_lock_that_matches_has_no_problems() -> None:
    assert problems(["app>=1", "tool[cli]"], {"app": "1.2", "lib": "3.0", "tool": "2.0", "click": "8.1"},
                    {"app": ["lib<4"], "tool": ['click>=8; extra == "cli"']}) == []


def test_a_requirement_the_lock_lacks_is_named_with_who_asks_for_it() -> None:
    assert problems(["app>=1"], {"app": "1.2"}, {"app": ["lib<4"]}) == [
        "app asks for lib<4, which dev.txt does not pin"]
    assert problems(["app>=1", "new-thing"], {"app": "1.2"}, {}) == [
        "pyproject.toml asks for new-thing, which dev.txt does not pin"]


def test_a_pin_outside_the_range_asked_for_is_named() -> None:
    assert problems(["msgspec>=0.24"], {"msgspec": "0.23.0"}, {}) == [
        "pyproject.toml asks for msgspec>=0.24, but dev.txt pins msgspec==0.23.0"]


def test_a_pin_nothing_needs_any_more_is_named() -> None:
    assert problems(["app"], {"app": "1.0", "old-lib": "2.0"}, {}) == [
        "dev.txt pins old-lib==2.0, which nothing in pyproject.toml needs"]


@pytest.mark.parametrize(("root", "needs_click"), [("tool", False), ("tool[cli]", True)])
def test_an_extra_brings_in_only_what_it_names(root: str, needs_click: bool) -> None:
    found = problems([root], {"tool": "2.0"}, {"tool": ['click>=8; extra == "cli"']})
    assert found == (["tool asks for click>=8; extra == \"cli\", which dev.txt does not pin"] if needs_click else [])


def test_a_local_build_satisfies_its_plain_version() -> None:
    # The machines keep PyTorch's CPU build, 2.13.0+cpu, which is what `torch==2.13.0` means here.
    assert problems(["torch==2.13.0"], {"torch": "2.13.0+cpu"}, {}) == []
