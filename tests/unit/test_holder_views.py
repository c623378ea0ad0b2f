"""A start's host view as the holder reads it (agent/processes/holder.py): the view's place bound whole, or where the
holder has none, each of its paths bound on their own; a view that names anything but absolute host paths and plain
names in it starts nothing."""

from __future__ import annotations

import json

from agent.isolation.sandbox import DEVICES_SOURCE, HOST, VIEW_SOURCE, HostView
from agent.processes.holder import view_of, with_devices, with_view

BINDS = (("/etc", "etc"), ("/usr", "usr"), ("/venv/bin/trainyard-drop", ".trainyard-drop"))
ARGV = ["bwrap", "--proc", "/proc", "--ro-bind", VIEW_SOURCE, HOST, "--tmpfs", f"{HOST}/etc/trainyard",
        "--remount-ro", "/", "--", f"{HOST}/.trainyard-drop", "7", "true"]


def test_the_view_s_place_is_bound_whole_or_each_of_its_paths_where_there_is_none() -> None:
    assert with_view(ARGV, VIEW_SOURCE, BINDS, "/tmp/trainyard-views-x/0") == [
        "bwrap", "--proc", "/proc", "--ro-bind", "/tmp/trainyard-views-x/0", HOST, *ARGV[6:]]
    # The same files at the same paths: a folder at HOST, each path bound into it, before what hides inside them.
    assert with_view(ARGV, VIEW_SOURCE, BINDS, None) == [
        "bwrap", "--proc", "/proc", "--dir", HOST, "--ro-bind", "/etc", f"{HOST}/etc", "--ro-bind", "/usr",
        f"{HOST}/usr", "--ro-bind", "/venv/bin/trainyard-drop", f"{HOST}/.trainyard-drop", *ARGV[6:]]
    # A command that binds no view (the host's root changed since the view was asked for) is left as it is, and
    # only bwrap's options are looked at: the job's own arguments of that text are the job's.
    assert with_view(["bwrap", "--dir", HOST, "--", "true"], VIEW_SOURCE, BINDS, "/v") == [
        "bwrap", "--dir", HOST, "--", "true"]
    job_s = ["bwrap", "--", "tool", "--ro-bind", VIEW_SOURCE, HOST]
    assert with_view(job_s, VIEW_SOURCE, BINDS, "/v") == job_s
    assert with_view([*ARGV, "--ro-bind", VIEW_SOURCE], VIEW_SOURCE, BINDS, "/v")[-2:] == ["--ro-bind", VIEW_SOURCE]


def test_the_holder_s_dev_is_bound_or_where_there_is_none_bwrap_makes_its_own_with_each_device() -> None:
    argv = ["bwrap", "--proc", "/proc", "--dev-bind", DEVICES_SOURCE, "/dev", "--perms", "1777", "--tmpfs",
            "/dev/shm", "--", f"{HOST}/.trainyard-drop", "--devpts", "/dev/pts", "7", "true"]
    assert with_devices(argv, DEVICES_SOURCE, ("/dev/nvidia0",), "/tmp/trainyard-views-x/1") == [
        *argv[:4], "/tmp/trainyard-views-x/1", *argv[5:]]
    assert with_devices(argv, DEVICES_SOURCE, ("/dev/nvidia0", "/dev/dri"), None) == [
        "bwrap", "--proc", "/proc", "--dev", "/dev", "--dev-bind-try", "/dev/nvidia0", "/dev/nvidia0",
        "--dev-bind-try", "/dev/dri", "/dev/dri", *argv[6:]]
    job_s = ["bwrap", "--", "tool", "--dev-bind", DEVICES_SOURCE, "/dev"]
    assert with_devices(job_s, DEVICES_SOURCE, (), "/v") == job_s


def test_a_view_is_read_from_the_agent_s_request_and_refused_when_it_names_more_than_paths_and_names() -> None:
    request = HostView(binds=BINDS).request
    assert view_of(request) == (VIEW_SOURCE, BINDS, None, ())
    with_devices_asked = HostView(binds=BINDS, devices=("/dev/nvidia0", "/dev/dri")).request
    assert view_of(with_devices_asked) == (VIEW_SOURCE, BINDS, DEVICES_SOURCE, ("/dev/nvidia0", "/dev/dri"))
    assert view_of(HostView(binds=BINDS, devices=()).request) == (VIEW_SOURCE, BINDS, DEVICES_SOURCE, ())
    for devices in (["/etc/passwd"], ["/dev/../etc"], ["dev/null"], ["/dev/"], "/dev/null", [["/dev/x"]]):
        asked = {"source": VIEW_SOURCE, "binds": [], "devices": {"source": DEVICES_SOURCE, "paths": devices}}
        assert view_of(json.dumps(asked)) is None, devices
    assert view_of(json.dumps({"source": VIEW_SOURCE, "binds": [], "devices": ["/dev/null"]})) is None
    for binds in ([["etc", "etc"]], [["/etc", "../etc"]], [["/etc", "/etc"]], [["/etc", ""]], [["/etc", "a//b"]],
                  [["/etc", "a/./b"]], [["/etc"]], "etc", [[1, 2]]):
        assert view_of(json.dumps({"source": VIEW_SOURCE, "binds": binds})) is None, binds
    assert view_of(json.dumps({"binds": []})) is None
    assert view_of({"source": VIEW_SOURCE, "binds": []}) is None  # text only
    assert view_of("not json") is None
