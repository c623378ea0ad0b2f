"""The per-job workspace of one node (SPEC L1), on the plain-directory backend.

The /workspace tree is built under a per-job root: each mount is a symlink into shared storage and
files such as hostfiles are written beside it. Paths the job was given as `/workspace/...` or as an
absolute file path are mapped to their place under the root, and the job is told where it is
through TRAINYARD_WORKSPACE.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from libs.contracts.events import NodeLaunch

BACKEND = "plain"
# The skeleton every node gets, even when the job mounts nothing there.
SKELETON = ("algorithm", "anno_dataset", "dataset/private", "dataset/favorite", "model/pretrained",
            "model/private", "model/favorite", "outputs", "volume")


class WorkspaceError(Exception):
    """The workspace cannot be built; the message names the missing piece."""


@dataclass(frozen=True)
class Workspace:
    root: Path  # per job attempt and rank
    path: Path  # what /workspace means for this job

    def translate(self, text: str, files: dict[str, Path]) -> str:
        """Map `/workspace/...` and generated file paths to their real places."""
        if text in files:
            return str(files[text])
        if text == "/workspace" or text.startswith("/workspace/"):
            return str(self.path) + text.removeprefix("/workspace")
        return text.replace("=/workspace/", f"={self.path}/")


def build_workspace(root: Path, storage: Path, launch: NodeLaunch) -> tuple[Workspace, dict[str, Path]]:
    """Create the tree for one node; returns it and where each generated file was written."""
    workspace = Workspace(root=root, path=root / "workspace")
    if workspace.path.exists():
        shutil.rmtree(workspace.path)
    for part in SKELETON:
        (workspace.path / part).mkdir(parents=True, exist_ok=True)
    for mount in launch.mounts:
        source = storage / mount.source
        if not source.exists():
            if mount.read_only:
                raise WorkspaceError(f"{mount.source} does not exist in shared storage ({storage})")
            source.mkdir(parents=True, exist_ok=True)
        target = workspace.path / mount.target
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source, target_is_directory=True)
    files: dict[str, Path] = {}
    for name, content in launch.files.items():
        path = root / "files" / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        files[name] = path
    return workspace, files
