"""Data staging never leaves the dataset (SPEC J14, D2): a link of a dataset that leads out of it (absolute, or
relative and climbing out, by itself, through other links or through a linked folder) is refused with its path
named, and nothing is copied; links that stay inside are copied as links; what is read is opened without
following links, so a link swapped in after the listing is never followed either."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.caches import datacache
from agent.caches.cachepolicy import MAX_LINK_HOPS, SourceFile, cache_key, links_refused
from agent.caches.datacache import DatasetCache, Progress, StagingError
from agent.caches.preparation import DataPreparation
from libs.contracts.agent import StageDataset
from tests.support.strategies import SETTINGS

HOLDER = "job-000000000001/1/0/0"
FOLDER = "/storage/datasets/x"
SECRET = b"the-signing-secret-0123456789"


def plain(path: str) -> SourceFile:
    return SourceFile(path=path, size=1, mtime_ns=1)


def link(path: str, target: str) -> SourceFile:
    return SourceFile(path=path, size=0, mtime_ns=1, link=target)


def refused(*files: SourceFile) -> dict[str, str]:
    return dict(links_refused(files, FOLDER))


# --- the rule ---------------------------------------------------------------------------------------------------


def test_links_that_stay_inside_the_dataset_are_let_by() -> None:
    assert refused(plain("a.bin"), plain("sub/b.bin"),
                   link("same", "a.bin"), link("sub/up", "../a.bin"), link("deep", "sub/./b.bin"),
                   link("sub/root", ".."), link("self", "."), link("chain", "same"), link("dir", "sub"),
                   link("through", "dir/b.bin"), link("missing", "not/yet/there")) == {}


def test_an_absolute_link_is_refused_even_into_the_dataset() -> None:
    assert refused(plain("a.bin"), link("secret", "/home/ops/.trainyard/auth-secret"),
                   link("own", f"{FOLDER}/a.bin")) == {
        "own": f"leads out of the dataset (to {FOLDER}/a.bin)",  # in the copy, that is shared storage
        "secret": "leads out of the dataset (to /home/ops/.trainyard/auth-secret)"}


def test_a_relative_link_climbing_out_is_refused_with_where_it_leads() -> None:
    assert refused(link("sub/out", "../../y/data"), link("back", "../x/a.bin")) == {
        "sub/out": "leads out of the dataset (to /storage/datasets/y/data)",
        "back": "leads out of the dataset (to /storage/datasets/x/a.bin)"}  # the copy is not named x


def test_a_chain_of_links_and_a_linked_folder_leading_out_are_refused() -> None:
    found = refused(link("a", "b"), link("b", "sub/c"), link("sub/c", "/etc/passwd"),
                    link("outside", "../.."), plain("inside/f"), link("reads", "outside/secret"))
    assert found == {"a": "leads out of the dataset (to /etc/passwd)", "b": "leads out of the dataset (to /etc/passwd)",
                     "sub/c": "leads out of the dataset (to /etc/passwd)",
                     "outside": "leads out of the dataset (to /storage)",
                     "reads": "leads out of the dataset (to /storage/secret)"}


def test_dot_dot_goes_up_from_where_a_link_really_led_as_the_kernel_does() -> None:
    tree = [plain("sub/inner/f"), link("d", "sub/inner")]
    assert refused(*tree, link("x", "d/../..")) == {}  # sub/inner, up to sub, up to the dataset
    assert refused(*tree, link("x", "d/../../..")) == {"x": "leads out of the dataset (to /storage/datasets)"}
    assert refused(*tree, link("x", "nothing/../..")) == {"x": "leads out of the dataset (to /storage/datasets)"}


def test_a_loop_of_links_is_refused() -> None:
    assert refused(link("a", "b"), link("b", "a")) == {
        "a": f"loops, or goes through more than {MAX_LINK_HOPS} links",
        "b": f"loops, or goes through more than {MAX_LINK_HOPS} links"}
    chain = [link(f"l{i}", f"l{i + 1}") for i in range(MAX_LINK_HOPS + 3)]
    assert "l0" in refused(*chain) and "l10" not in refused(*chain)


def test_a_links_target_is_part_of_the_cache_key_and_datasets_without_links_keep_theirs() -> None:
    files = [plain("a.bin")]
    assert cache_key("datasets/x", [*files, link("l", "a.bin")]) != cache_key("datasets/x", [*files, link("l", "b")])
    unchanged = hashlib.sha256(b"datasets/x\0a.bin\x001\x001").hexdigest()[:24]  # the key before links counted
    assert cache_key("datasets/x", files) == unchanged


# Against the kernel: over random trees of links, the rule lets a link by exactly when the system's own
# resolution of it (os.path.realpath, following links on disk) stays inside the dataset's folder.
NAMES = ["a", "b", "d", "l1", "l2", "sub/l3"]
STEPS = st.sampled_from(["..", ".", "a", "b", "d", "l1", "l2", "sub", "l3", "nope"])
TARGETS = st.one_of(st.lists(STEPS, min_size=1, max_size=4).map("/".join), st.just("/etc"))


@settings(SETTINGS, max_examples=150)
@given(st.dictionaries(st.sampled_from(NAMES), TARGETS, min_size=1))
def test_the_rule_agrees_with_the_kernel(links: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as where:
        folder = Path(where) / "storage" / "datasets" / "x"
        (folder / "sub").mkdir(parents=True)
        for name in ("a", "b", "l1", "l2"):  # what is not a link is a file, and d a folder
            if name not in links:
                (folder / name).write_text(name)
        if "d" not in links:
            (folder / "d").mkdir()
        for name, target in links.items():
            os.symlink(target, folder / name)
        verdicts = dict(links_refused([link(name, target) for name, target in links.items()], str(folder)))
        for name in links:
            if name in verdicts and verdicts[name].startswith("loops"):
                continue  # the kernel gives up too (ELOOP); realpath does not say so
            real = os.path.realpath(folder / name)
            inside = os.path.commonpath([real, str(folder)]) == str(folder)
            assert (name not in verdicts) == inside, (name, links, real, verdicts)


# --- staging --------------------------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> DatasetCache:
    opened = DatasetCache(tmp_path / "node" / "cache", tmp_path / "storage", workers=3)
    opened.open()
    return opened


def seeded(cache: DatasetCache, name: str) -> Path:
    folder = cache.storage / "datasets" / name
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"a" * 1000)
    (folder / "sub" / "b.bin").write_bytes(b"b" * 10)
    return folder


def a_secret(tmp_path: Path) -> Path:
    secrets = tmp_path / "state"
    secrets.mkdir(exist_ok=True)
    (secrets / "auth-secret").write_bytes(SECRET)
    return secrets / "auth-secret"


def nothing_of_it_cached(cache: DatasetCache) -> None:
    assert cache.entries() == [] and list(cache.partial_dir.iterdir()) == []
    assert not any(p.is_file() for p in cache.pins_dir.rglob("*"))
    for path in cache.root.rglob("*"):
        assert path.is_symlink() or not path.is_file() or SECRET not in path.read_bytes()


async def test_a_link_to_a_secret_outside_the_dataset_is_refused_by_name_and_nothing_is_copied(
        cache: DatasetCache, tmp_path: Path) -> None:
    secret = a_secret(tmp_path)
    folder = seeded(cache, "x")
    (folder / "sub" / "link").symlink_to(secret)
    with pytest.raises(StagingError) as refusal:
        await cache.stage("datasets/x", lambda _: None, HOLDER)
    assert str(refusal.value) == (f"refused datasets/x/sub/link: a link that leads out of the dataset (to {secret})")
    assert not refusal.value.node_fault  # the dataset is at fault: the job fails, on any node alike
    nothing_of_it_cached(cache)


async def test_a_linked_folder_leading_out_and_a_relative_climb_are_refused(cache: DatasetCache,
                                                                            tmp_path: Path) -> None:
    secret = a_secret(tmp_path)
    folder = seeded(cache, "x")
    (folder / "state").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(StagingError, match=re.escape(f"refused datasets/x/state: a link that leads out of the dataset "
                                                     f"(to {secret.parent})")):
        await cache.stage("datasets/x", lambda _: None, HOLDER)
    (folder / "state").unlink()
    os.symlink("../../../../state/auth-secret", folder / "sub" / "climb")
    os.symlink("sub/climb", folder / "via")
    with pytest.raises(StagingError, match=re.escape(f"refused datasets/x/sub/climb: a link that leads out of the "
                                                     f"dataset (to {secret}) (and 1 other link(s))")):
        await cache.stage("datasets/x", lambda _: None, HOLDER)
    nothing_of_it_cached(cache)


async def test_a_dataset_folder_that_is_a_link_out_of_shared_storage_is_refused(cache: DatasetCache,
                                                                               tmp_path: Path) -> None:
    secret = a_secret(tmp_path)
    (cache.storage / "datasets").mkdir(parents=True)
    (cache.storage / "datasets" / "x").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(StagingError, match=r"^refused datasets/x: a link that leads out of its place in shared"):
        await cache.stage("datasets/x", lambda _: None, HOLDER)
    nothing_of_it_cached(cache)


async def test_links_inside_the_dataset_are_copied_as_links_and_read_as_in_shared_storage(
        cache: DatasetCache) -> None:
    folder = seeded(cache, "x")
    os.symlink("a.bin", folder / "same")
    os.symlink("../a.bin", folder / "sub" / "up")
    os.symlink("sub", folder / "dir")
    os.symlink("gone", folder / "dangling")
    (cache.storage / "datasets" / "v-latest").symlink_to("x", target_is_directory=True)  # a folder linked inside
    local, staged = await cache.stage("datasets/v-latest", lambda _: None, HOLDER)
    assert (staged.files, staged.bytes) == (2, 1010)  # plain files: what the links lead to is counted once
    assert os.readlink(local / "same") == "a.bin" and (local / "same").read_bytes() == b"a" * 1000
    assert (local / "sub" / "up").read_bytes() == b"a" * 1000 and (local / "dir" / "b.bin").read_bytes() == b"b" * 10
    assert os.readlink(local / "dangling") == "gone" and not (local / "dangling").exists()
    os.symlink("sub/b.bin", folder / "same2")  # a new link: a new entry
    _, again = await cache.stage("datasets/x", lambda _: None, HOLDER)
    assert again.key != staged.key and not again.hit


async def test_a_link_swapped_in_after_the_listing_is_never_followed(cache: DatasetCache, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    secret = a_secret(tmp_path)
    folder = seeded(cache, "x")
    listed = datacache.list_source

    def swapping(storage: Path, source: str) -> datacache.Listing:
        listing = listed(storage, source)
        if not (folder / "sub" / "b.bin").is_symlink():  # the first listing: then the attacker strikes
            (folder / "sub" / "b.bin").unlink()
            (folder / "sub" / "b.bin").symlink_to(secret)
        return listing

    monkeypatch.setattr(datacache, "list_source", swapping)
    with pytest.raises(StagingError, match=r"sub/b\.bin changed while it was copied: it is no longer a plain file"):
        await cache.stage("datasets/x", lambda _: None, HOLDER)
    cache.unpin(HOLDER)  # pinned once listed, until the rank's end releases it
    nothing_of_it_cached(cache)


def test_a_folder_swapped_for_a_link_after_the_listing_is_never_followed(cache: DatasetCache,
                                                                          tmp_path: Path) -> None:
    secret = a_secret(tmp_path)
    folder = seeded(cache, "x")
    listing = datacache.list_source(cache.storage, "datasets/x")
    (folder / "sub" / "b.bin").unlink()
    (folder / "sub").rmdir()
    (folder / "sub").symlink_to(secret.parent, target_is_directory=True)
    (secret.parent / "b.bin").write_bytes(SECRET[:10])  # the size listed: only the path tells them apart
    [b] = [f for f in listing.files if f.path == "sub/b.bin"]
    target = cache.root / "copy" / "b.bin"
    with pytest.raises(StagingError, match="no longer a plain file"):
        datacache.copy_verified(listing, b, target, Progress("datasets/x", 10, 1))
    assert not target.exists()


async def test_a_preload_of_a_dataset_with_a_link_leading_out_fails_saying_why(cache: DatasetCache,
                                                                                tmp_path: Path) -> None:
    secret = a_secret(tmp_path)
    folder = seeded(cache, "x")
    (folder / "link").symlink_to(secret)
    staging = DataPreparation(cache, "node-a")
    staging.preload(StageDataset(source="datasets/x", preload_id="preload-0123456789ab"))
    async with asyncio.timeout(10):
        while not cache.failures:
            await asyncio.sleep(0.02)
    [failure] = cache.failures
    assert failure.source == "datasets/x"
    assert failure.reason == f"refused datasets/x/link: a link that leads out of the dataset (to {secret})"
    nothing_of_it_cached(cache)
