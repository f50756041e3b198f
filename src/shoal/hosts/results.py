"""What a hosted session's place gives back: a patch after every turn, a branch at the end.

A session hosted on a cluster node works in a copy or worktree made on that node. If the node
goes away, so does the directory; so after every turn the node takes a patch of the
directory against how it was when made, and the patch travels back to the caller, where it
outlives the node. A fresh copy with the patch applied is the same work again.

The patch is git's, taken with a scratch repository of the node's own (`--git-dir` apart,
`--work-tree` the place): the repository a worktree belongs to is never written to, and a
plain directory needs no repository at all. `git add -A` keeps its stat cache in the scratch
index, so a turn that touched three files costs three hashes, not the tree. What the
place's own `.gitignore` ignores is not work and is not in the patch; binary files are
(`--binary`).

At the end, a place that is a git work tree can also give its work back as a branch pushed to
a remote the user names (`push_branch`): everything in it committed on the place's branch
(a worktree's `shoal/<task>`; a throwaway name for a copy) and pushed from the node.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shoal.errors import PlaceError

GIT_TIMEOUT = 300.0  # a first snapshot hashes the whole tree


class Snapshots:
    """Patches of one directory against its state when `start()` was called."""

    def __init__(self, workdir: Path, scratch: Path) -> None:
        self.workdir = workdir
        self.git_dir = scratch / "snapshots.git"
        self.index = scratch / "snapshots.index"
        self.base: str | None = None

    def _git(self, *argv: str, stdin: str | None = None) -> str:
        env = {**os.environ, "GIT_INDEX_FILE": str(self.index), "GIT_TERMINAL_PROMPT": "0",
               "GIT_OPTIONAL_LOCKS": "0"}
        proc = subprocess.run(["git", f"--git-dir={self.git_dir}", f"--work-tree={self.workdir}", *argv],
                              cwd=self.workdir, input=stdin, capture_output=True, text=True, env=env,
                              timeout=GIT_TIMEOUT)
        if proc.returncode != 0:
            raise PlaceError(f"`git {' '.join(argv)}` in {self.workdir} failed: {proc.stderr.strip()}")
        return proc.stdout

    def _tree(self) -> str:
        self._git("add", "-A", ".")
        return self._git("write-tree").strip()

    def start(self) -> None:
        """Remember the directory as it is now: later patches are against this."""
        if not self.git_dir.exists():
            subprocess.run(["git", "init", "--quiet", "--bare", str(self.git_dir)], check=True,
                           capture_output=True, timeout=GIT_TIMEOUT)
        self.base = self._tree()

    def patch(self) -> str:
        """Everything changed since `start()`: added, modified and deleted files ("" for none)."""
        if self.base is None:
            raise PlaceError("no snapshot was started for this place")
        return self._git("diff-tree", "-p", "--binary", "--full-index", self.base, self._tree())

    def apply(self, patch: str) -> None:
        """Put a patch taken of an earlier copy of this place onto this one."""
        if patch:
            self._git("apply", "--binary", "--whitespace=nowarn", "-", stdin=patch)


def changed_paths(patch: str) -> list[str]:
    """The files a patch touches, for saying what a kept patch holds."""
    return [line.split(" b/", 1)[-1] for line in patch.splitlines() if line.startswith("diff --git ")]


def _run_git(workdir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(["git", *argv], cwd=workdir, capture_output=True, text=True, env=env, timeout=GIT_TIMEOUT)


def push_branch(workdir: Path, remote: str, branch: str, message: str) -> str:
    """Commit everything in `workdir` (a git work tree) and push it to `remote` as `branch`.

    The commit is made on whatever HEAD the place has (a worktree's own branch, a copy's
    checkout) and pushed as `refs/heads/<branch>` there; nothing is pushed anywhere else.
    Returns the commit pushed."""
    inside = _run_git(workdir, "rev-parse", "--is-inside-work-tree")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        raise PlaceError(f"cannot push the work in {workdir}: it is not a git work tree")
    who: list[str] = []
    if not _run_git(workdir, "config", "user.email").stdout.strip():
        who = ["-c", "user.name=shoal", "-c", "user.email=shoal@localhost"]  # a node with no git identity
    steps = [["add", "-A"]]
    if _run_git(workdir, "status", "--porcelain").stdout.strip():
        steps.append([*who, "commit", "--quiet", "-m", message])  # only work not yet committed
    steps.append(["push", "--quiet", remote, f"HEAD:refs/heads/{branch}"])
    for argv in steps:
        done = _run_git(workdir, *argv)
        if done.returncode != 0:
            raise PlaceError(f"`git {' '.join(argv)}` in {workdir} failed: {(done.stderr or done.stdout).strip()}")
    return _run_git(workdir, "rev-parse", "HEAD").stdout.strip()
