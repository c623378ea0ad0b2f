"""Data preparation and the nodes' dataset caches on the real stack (SPEC J14, D1, D2): datasets copied side by
side before the command, read there, reused by the next job, copied again once changed; a disk under
pressure takes no new work until it is relieved; a dataset whose links lead out of it is refused, never
copied."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest

from client.api import TrainyardError
from devstack.stack import agent_argv, provision_node_token
from libs.contracts.events import JobResuming, NodeProcessStarted
from libs.contracts.jobspec import AlgorithmRef, DatasetRef, JobSpec, OutputRef
from libs.contracts.operations.cache import NodeCache
from libs.contracts.operations.cluster import NodeView
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

# Reads both datasets; then where alpha really is (a link under the plain backend, a bind mount under bwrap).
READ = ('bash -c \'for d in alpha beta; do cat "$TRAINYARD_WORKSPACE/dataset/private/$d/"part-* | sha256sum; done; '
        '{ readlink -f "$TRAINYARD_WORKSPACE/dataset/private/alpha"; cat /proc/self/mountinfo; } '
        '| grep -o "dataset-cache/entries/[0-9a-f]*" | sort -u\'')


def reader(name: str) -> JobSpec:
    return JobSpec(name=name, flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"), command=READ,
                   datasets=[DatasetRef(name="alpha"), DatasetRef(name="beta")], data_preparation=True,
                   node_names=["node-a"], output=OutputRef(name=name))


def seed(stack: Stack, name: str, parts: int = 4, size: int = 3_000_000) -> None:
    folder = stack.storage / "datasets" / name
    folder.mkdir(parents=True, exist_ok=True)
    for part in range(parts):
        (folder / f"part-{part}").write_bytes(os.urandom(size))


async def staged(stack: Stack, job_id: str) -> dict[str, bool]:
    """Per dataset, whether the job's node found it in its cache (from the job's events)."""
    events = [e.event for e in await (await stack.api()).events(job_id) if isinstance(e.event, NodeProcessStarted)]
    return {dataset.source: dataset.hit for event in events for dataset in event.staged}


async def ran(stack: Stack, spec: JobSpec) -> tuple[str, list[str]]:
    accepted = await (await stack.api()).submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    return accepted.job_id, await stack.logs(accepted.job_id)


async def cache_until(stack: Stack, done: Callable[[NodeCache], bool], node: str = "node-a") -> NodeCache:
    api = await stack.api()
    async with asyncio.timeout(90):
        while True:
            found = await api.cache(node)
            if found and done(found[0]):
                return found[0]
            await asyncio.sleep(0.3)


async def test_datasets_are_staged_side_by_side_reused_and_copied_again_once_changed(stack: Stack) -> None:
    seed(stack, "alpha")
    seed(stack, "beta")
    await stack.up()

    first, lines = await ran(stack, reader("first"))
    notes = [line.removeprefix("[0] [trainyard] data preparation: ") for line in lines if "data preparation:" in line]
    begun = [i for i, note in enumerate(notes) if note.startswith("copying ")]
    ready = [i for i, note in enumerate(notes) if " ready: " in note]
    assert len(begun) == 2 and len(ready) == 2 and max(begun) < min(ready), notes  # both copies under way at once
    assert await staged(stack, first) == {"datasets/alpha": False, "datasets/beta": False}
    digests = [line for line in lines if line.endswith("  -")]
    assert len(digests) == 2  # the job read both datasets through /workspace/dataset/private/...
    assert any("dataset-cache/entries/" in line for line in lines)  # ... which are the node's local copies

    second, lines = await ran(stack, reader("second"))
    assert await staged(stack, second) == {"datasets/alpha": True, "datasets/beta": True}
    assert not any("data preparation: copying" in line for line in lines)
    assert [line for line in lines if line.endswith("  -")] == digests

    seed(stack, "alpha", parts=1, size=1000)  # part-0 rewritten in shared storage
    third, lines = await ran(stack, reader("third"))
    assert await staged(stack, third) == {"datasets/alpha": False, "datasets/beta": True}
    alpha, beta = (line for line in lines if line.endswith("  -"))
    assert alpha != digests[0] and beta == digests[1]

    # The cache as node-a reported it: both copies of alpha and one of beta, none in use any more.
    cache = await cache_until(stack, lambda c: len(c.entries) == 3 and not any(e.pins for e in c.entries))
    assert sorted(e.source for e in cache.entries) == ["datasets/alpha", "datasets/alpha", "datasets/beta"]
    assert all(e.bytes > 0 and e.files >= 4 for e in cache.entries)


async def node_until(stack: Stack, name: str, done: Callable[[NodeView], bool]) -> NodeView:
    api = await stack.api()
    async with asyncio.timeout(90):
        while True:
            node = next(n for n in await api.nodes() if n.info.name == name)
            if done(node):
                return node
            await asyncio.sleep(0.3)


async def test_a_disk_under_pressure_takes_no_new_work_until_relieved(stack: Stack) -> None:
    api = await stack.up()
    # Any disk is "full" at a threshold of a tenth of a percent: node-a's agent reports the pressure.
    await api.change_settings(disk_high_percent=0.1, disk_low_percent=0.05)
    full = await node_until(stack, "node-a", lambda n: n.status == "disk-full")
    assert any("local disk" in problem and "takes work again at or below 0.05%" in problem for problem in full.problems)
    accepted = await api.submit(JobSpec(name="waits", flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"),
                                        command="true", node_names=["node-a"], output=OutputRef(name="waits")))
    await asyncio.sleep(2)
    assert (await api.get_job(accepted.job_id)).job.status == "queued"

    await api.change_settings(disk_high_percent=100, disk_low_percent=99.9)
    await node_until(stack, "node-a", lambda n: n.status == "ready")
    job = await stack.wait_until(accepted.job_id, "ended", timeout=60)
    assert job.status == "succeeded", job.reason


@pytest.mark.slow_loss  # its agent must be back, or its heartbeats keep coming, however busy the machine
async def test_an_agent_killed_mid_copy_begins_again_and_no_partial_copy_is_used(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_STAGE_MIB_PER_SECOND", "8")  # the agents' setting: a copy of some seconds
    seed(stack, "alpha", parts=4, size=6_000_000)
    seed(stack, "beta", parts=1, size=1000)
    expected = hashlib.sha256(b"".join((stack.storage / "datasets" / "alpha" / f"part-{i}").read_bytes()
                                       for i in range(4))).hexdigest()
    api = await stack.up()
    accepted = await api.submit(reader("interrupted"))
    async with asyncio.timeout(60):  # the copy of alpha is under way
        while not any("datasets/alpha" in line and "MiB/s" in line for line in await stack.logs(accepted.job_id)):
            await asyncio.sleep(0.2)

    stack.crash("agent-node-a")  # kill -9 mid-copy: a partial copy is left on the node's disk
    cache = stack.home / "agents" / "node-a" / "dataset-cache"
    assert any((cache / "partial").iterdir())
    stack.start("agent-node-a")

    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    lines = await stack.logs(accepted.job_id)
    assert sum("data preparation: copying datasets/alpha" in line for line in lines) == 2  # begun again
    assert f"[0] {expected}  -" in lines  # the job read the whole dataset
    assert list((cache / "partial").iterdir()) == []
    assert len(list((cache / "entries").iterdir())) == 2  # one entry each, none half made


async def test_a_preloaded_dataset_is_found_in_the_cache_by_the_first_job_and_a_missing_one_is_refused(
        stack: Stack) -> None:
    seed(stack, "alpha")
    seed(stack, "beta")
    api = await stack.up()
    since = datetime.now(UTC) - timedelta(seconds=2)
    accepted = await api.preload("alpha", nodes=["node-a"])
    assert (accepted.source, accepted.nodes) == ("datasets/alpha", ["node-a"])
    progress = [states async for states in api.preload_progress(accepted, since)]
    assert [(s.node, s.state) for s in progress[-1]] == [("node-a", "done")]
    again = await api.preload("alpha", nodes=["node-a"], preload_id=accepted.preload_id)
    assert again == accepted  # a repeated request is the same preload

    job_id, _ = await ran(stack, reader("warm"))
    assert await staged(stack, job_id) == {"datasets/alpha": True, "datasets/beta": False}

    with pytest.raises(TrainyardError, match="datasets/nowhere does not exist in shared storage"):
        await api.preload("nowhere", nodes=["node-a"])
    with pytest.raises(TrainyardError, match="no such node: node-z"):
        await api.preload("alpha", nodes=["node-z"])


@pytest.mark.cluster(Path(__file__).parent / "cluster-data.yaml")
async def test_a_job_that_waits_has_its_datasets_copied_to_its_predicted_node_meanwhile(stack: Stack) -> None:
    seed(stack, "alpha")
    seed(stack, "beta")
    api = await stack.up()
    # The blocker's duration limit lets the prediction plan where the waiting job starts (S6).
    blocker = await api.submit(JobSpec(name="blocker", flavors=["cpu-2"], algorithm=AlgorithmRef(name="env-probe"),
                                       command="sleep 600", duration="10m", node_names=["node-a"],
                                       output=OutputRef(name="blocker")))
    await stack.wait_until(blocker.job_id, "running")
    waiting = await api.submit(reader("waits"))
    assert (await api.get_job(waiting.job_id)).job.status == "queued"

    # While it waits for node-a, node-a's cache gets both its datasets.
    cache = await cache_until(stack, lambda c: {"datasets/alpha", "datasets/beta"} <= {e.source for e in c.entries})
    assert not any(e.pins for e in cache.entries)  # copied for no job: nothing holds them
    assert (await api.get_job(waiting.job_id)).job.status == "queued"

    await api.stop([blocker.job_id])
    job = await stack.wait_until(waiting.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    assert await staged(stack, waiting.job_id) == {"datasets/alpha": True, "datasets/beta": True}


@pytest.mark.cluster(Path(__file__).parent / "cluster-data-uneven.yaml")
async def test_a_node_that_cannot_hold_the_copy_sends_the_job_to_another_node(stack: Stack) -> None:
    seed(stack, "alpha")
    seed(stack, "beta")
    await stack.up()
    # node-a's cache is where a file stands: nothing can be written there, as on a broken or full disk.
    blocked = stack.home / "blocked"
    blocked.write_text("not a folder")
    readied = stack.processes.log("agent-node-a").count("agent.ready")
    stack.crash("agent-node-a")
    secret = Path(stack.processes.env["TRAINYARD_AUTH_SECRET_FILE"])
    stack.processes.start("agent-node-a", agent_argv("node-a", stack.cluster, stack.home / "agents"),
                          env={**provision_node_token(stack.processes.home, "node-a", secret),
                               "TRAINYARD_DATA_CACHE": str(blocked / "cache")})
    # Submitted once the new agent is up and node-a ready: a job placed while the node was counted lost (its new
    # agent slow to start) would go to node-b without ever being sent to node-a.
    async with asyncio.timeout(120):
        while stack.processes.log("agent-node-a").count("agent.ready") <= readied:
            await asyncio.sleep(0.2)
    await node_until(stack, "node-a", lambda n: n.status == "ready")
    api = await stack.api()
    spec = msgspec.structs.replace(reader("moved"), node_names=[])

    accepted = await api.submit(spec)
    job = await stack.wait_until(accepted.job_id, "ended", timeout=120)
    assert job.status == "succeeded", job.reason
    assert {p.node for p in job.placement} == {"node-b"} and job.resumes == 0
    events = [e.event for e in await api.events(accepted.job_id)]
    [moved] = [e for e in events if isinstance(e, JobResuming)]
    assert moved.before_start and moved.exclude_nodes == ["node-a"]
    assert "data preparation failed on node node-a: cannot write the cache" in moved.reason


def read_all(name: str, dataset: str) -> JobSpec:
    """A job that prints every file its staged dataset holds, following links as any reader would."""
    command = f'find -L "$TRAINYARD_WORKSPACE/dataset/private/{dataset}" -type f -exec cat {{}} +'
    return JobSpec(name=name, flavors=["cpu-1"], algorithm=AlgorithmRef(name="env-probe"),
                   command=f"bash -c {shlex.quote(command)}", datasets=[DatasetRef(name=dataset)],
                   data_preparation=True, node_names=["node-a"], output=OutputRef(name=name))


async def test_a_dataset_whose_links_lead_out_of_it_is_refused_and_nothing_of_it_is_copied(stack: Stack) -> None:
    secret = Path(stack.processes.env["TRAINYARD_AUTH_SECRET_FILE"])
    seed(stack, "leaky-file", parts=1, size=1000)
    (stack.storage / "datasets" / "leaky-file" / "secret").symlink_to(secret)  # a link to the signing secret
    seed(stack, "leaky-dir", parts=1, size=1000)
    (stack.storage / "datasets" / "leaky-dir" / "state").symlink_to(secret.parent, target_is_directory=True)
    api = await stack.up()
    content = secret.read_text().strip()
    assert content

    jobs = {dataset: (await api.submit(read_all(dataset, dataset))).job_id for dataset in ("leaky-file", "leaky-dir")}
    refused = {"leaky-file": f"refused datasets/leaky-file/secret: a link that leads out of the dataset (to {secret})",
               "leaky-dir": f"refused datasets/leaky-dir/state: a link that leads out of the dataset "
                            f"(to {secret.parent})"}
    for dataset, job_id in jobs.items():
        job = await stack.wait_until(job_id, "ended", timeout=120)
        assert job.status == "failed" and job.resumes == 0, job.reason  # the dataset at fault: no other node tried
        lines = await stack.logs(job_id)
        assert f"[0] [trainyard] data preparation failed on node node-a: {refused[dataset]}" in lines, lines
        assert job.reason == f"rank 0 could not start: data preparation failed on node node-a: {refused[dataset]}"
        assert not any(content in line for line in lines)

    # A preload of it fails the same way, saying why where its progress shows.
    since = datetime.now(UTC) - timedelta(seconds=2)
    accepted = await api.preload("leaky-file", nodes=["node-a"])
    progress = [states async for states in api.preload_progress(accepted, since)]
    [node] = progress[-1]
    assert (node.node, node.state) == ("node-a", "failed") and node.reason == refused["leaky-file"]

    # Nothing of either dataset was copied: no entry, no partial copy, the secret nowhere in the cache.
    cache = stack.home / "agents" / "node-a" / "dataset-cache"
    assert list((cache / "entries").iterdir()) == [] and list((cache / "partial").iterdir()) == []
    for path in cache.rglob("*"):
        assert path.is_symlink() or not path.is_file() or content.encode() not in path.read_bytes(), path
    assert not any(e.source.startswith("datasets/leaky") for c in await api.cache("node-a") for e in c.entries)


async def test_links_inside_a_dataset_are_staged_as_links_and_read_as_in_shared_storage(stack: Stack) -> None:
    seed(stack, "linked", parts=2, size=1000)
    folder = stack.storage / "datasets" / "linked"
    (folder / "sub").mkdir()
    (folder / "sub" / "labels.txt").write_text("cat\n")
    os.symlink("part-0", folder / "latest")
    os.symlink("../part-1", folder / "sub" / "previous")
    os.symlink("sub", folder / "annotations")
    await stack.up()
    command = ('cd "$TRAINYARD_WORKSPACE/dataset/private/linked" && readlink latest && '
               'cat latest part-0 sub/previous part-1 | sha256sum && cat annotations/labels.txt')
    spec = msgspec.structs.replace(read_all("linked", "linked"), command=f"bash -c {shlex.quote(command)}")
    job_id, lines = await ran(stack, spec)
    twice = b"".join((folder / part).read_bytes() for part in ("part-0", "part-0", "part-1", "part-1"))
    expected = ["[0] part-0", f"[0] {hashlib.sha256(twice).hexdigest()}  -", "[0] cat"]
    assert [line for line in lines if line in expected] == expected, lines
    assert await staged(stack, job_id) == {"datasets/linked": False}
