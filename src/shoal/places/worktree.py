"""A worktree apiece: a git worktree on a new branch named after the task, made on the first turn.

    s = agent.session(where=shoal.Worktree(repo, task="fix-parser"))   # branch shoal/fix-parser

Worktrees go under `<repo>/.shoal/worktrees/<task>` (`.shoal/` is added to the repo's
`.git/info/exclude`, so they never show up in the user's `git status`), or under `root=`.
The branch is `shoal/<task>`, made unique (`shoal/<task>-2`, ...) when taken.

Many sessions on one repo all open at once: git takes its own locks (`config.lock`, the
worktree admin files) and two `git worktree add` at the same moment can collide on them, so
making and removing worktrees is serialised per repository — an asyncio lock within this
process and an flock on a file in the repo's git dir across processes.

Never lose work: when given back, a worktree holding uncommitted changes, or commits on no
other branch, is kept — the directory and the branch both — and `close()` says where. One
with nothing new is removed, its branch with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from shoal.errors import BadArgument, DirtyBase, NotAGitRepo, PlaceError
from shoal.places import registry
from shoal.places.base import check_keep, check_path

Keep = Literal["changed", "always", "never"]
GIT_TIMEOUT = 60.0
LOCK_RETRIES = 6  # git's own lock taken by someone else (an editor, a hook): retry, backing off
LOCKED = re.compile(r"\.lock'?: File exists|Unable to create .*\.lock|another git process", re.I)
_locks: dict[str, asyncio.Lock] = {}


class GitFailed(PlaceError):
    def __init__(self, argv: list[str], code: int, out: str) -> None:
        self.code, self.out = code, out
        super().__init__(f"`git {' '.join(argv)}` failed (exit {code}): {out.strip()}")


async def git(cwd: Path, *argv: str, check: bool = True, stdin: str | None = None) -> str:
    """Run git in `cwd` (retrying when git's own lock files are held); its stdout."""
    for attempt in range(LOCK_RETRIES + 1):
        proc = await asyncio.create_subprocess_exec(
            "git", *argv, cwd=str(cwd),
            stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"})
        try:
            async with asyncio.timeout(GIT_TIMEOUT):
                out, err = await proc.communicate(None if stdin is None else stdin.encode())
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        text = err.decode(errors="replace")
        if proc.returncode == 0 or not check:
            return out.decode(errors="replace")
        if attempt < LOCK_RETRIES and LOCKED.search(text):
            await asyncio.sleep(0.1 * 2**attempt)
            continue
        raise GitFailed(list(argv), proc.returncode or 1, text or out.decode(errors="replace"))
    raise AssertionError("unreachable")


def find_repo(path: Path) -> Path | None:
    """The top of the git work tree holding `path` (by stat alone), or None."""
    for d in (path, *path.parents):
        if (d / ".git").exists():
            return d
    return None


@contextlib.asynccontextmanager
async def repo_lock(common_dir: Path) -> AsyncIterator[None]:
    """Serialise worktree changes on one repository: in this process, and across processes."""
    lock = _locks.setdefault(str(common_dir), asyncio.Lock())
    async with lock:
        fd = os.open(common_dir / "shoal-worktrees.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock


def slug(task: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", task).strip("-.")
    s = re.sub(r"\.\.+|\.lock$", "-", s)  # what git refuses in a ref name
    return s[:60] or "task"


async def status_lines(path: Path) -> list[str]:
    """Uncommitted changes (tracked and untracked, not ignored) in a work tree."""
    out = await git(path, "status", "--porcelain", "--untracked-files=all")
    return [line for line in out.splitlines() if line.strip()]


async def unique_commits(repo: Path, branch: str) -> int:
    """Commits on `branch` that are on no other branch, tag or remote branch.

    The other refs are listed and handed over one by one (on stdin), not by pattern: what
    decides whether work is deleted must be obviously right. Anything unreadable counts as
    work (a huge number), never as none."""
    own = f"refs/heads/{branch}"
    refs = (await git(repo, "for-each-ref", "--format=%(refname)", "refs/heads", "refs/tags", "refs/remotes")).split()
    if own not in refs:
        return 0  # the branch is gone: nothing of it to keep
    others = "".join(f"^{r}\n" for r in refs if r != own)  # `--not` would not reach stdin
    out = await git(repo, "rev-list", "--count", own, "--stdin", stdin=others)
    return int(out.strip()) if out.strip().isdigit() else 1 << 30


async def holds_work(repo: Path, path: Path, branch: str) -> tuple[int, int]:
    """(uncommitted changes, commits on no other branch) of one worktree."""
    dirty = len(await status_lines(path)) if path.is_dir() else 0
    return dirty, await unique_commits(repo, branch)


def what(dirty: int, commits: int) -> str:
    parts = []
    if commits:
        parts.append(f"{commits} commit(s) on no other branch")
    if dirty:
        parts.append(f"{dirty} uncommitted change(s)")
    return ", ".join(parts) or "nothing new"


class Worktree:
    kind = "worktree"

    def __init__(self, repo: str | Path = ".", task: str | None = None, *, base: str = "HEAD",
                 allow_dirty: bool = False, root: str | Path | None = None, keep: Keep = "changed") -> None:
        """`base`: what the branch starts from. `allow_dirty`: branch even when the repo has
        uncommitted changes (they are not carried over). `keep`: "changed" (default) keeps a
        worktree holding work; "always" keeps every one; "never" removes it whatever it holds."""
        check_path("Worktree's repo", repo)
        check_path("Worktree's root", root, optional=True)
        check_keep(keep)
        if task is not None and not isinstance(task, str):
            raise BadArgument(f"Worktree's task must be a string (it names the branch shoal/<task>), got {task!r}")
        if not isinstance(base, str) or not base:
            raise BadArgument(f"Worktree's base must be a commit-ish string such as 'HEAD' or 'main', got {base!r}")
        self.repo_arg = Path(repo).expanduser().absolute()
        self.task = slug(task) if task else f"task-{uuid.uuid4().hex[:6]}"
        self.base = base
        self.allow_dirty = allow_dirty
        self.root = Path(root).expanduser().absolute() if root else None
        self.keep = keep
        self.id = registry.new_id("worktree")
        self.repo: Path | None = None
        self.common: Path | None = None
        self.path: Path | None = None
        self.branch: str | None = None
        self.base_commit: str | None = None

    def check(self) -> None:
        if not self.repo_arg.is_dir():
            raise NotAGitRepo(f"cannot make a worktree of {self.repo_arg}: no such directory")
        if self.root is not None and self.root.exists() and not self.root.is_dir():
            raise PlaceError(f"cannot put worktrees under {self.root}: it is not a directory; pass another root=")
        if find_repo(self.repo_arg) is None:
            raise NotAGitRepo(f"cannot make a worktree of {self.repo_arg}: it is not inside a git repository "
                              f"(`git init` it, or pass a repository's path)")

    async def open(self) -> Path:
        if self.path is not None:
            return self.path
        self.check()
        try:
            top = Path((await git(self.repo_arg, "rev-parse", "--show-toplevel")).strip())
            common = Path((await git(top, "rev-parse", "--path-format=absolute", "--git-common-dir")).strip())
        except GitFailed as exc:
            raise NotAGitRepo(f"cannot make a worktree of {self.repo_arg}: {exc.out.strip()}") from None
        try:
            commit = (await git(top, "rev-parse", "--verify", "--quiet", f"{self.base}^{{commit}}")).strip()
        except GitFailed:
            raise PlaceError(f"cannot make a worktree of {top} from {self.base!r}: no such commit "
                             f"(a repository with no commits yet has none to branch from)") from None
        self.repo, self.common = top, common
        root = self.root or top / ".shoal" / "worktrees"
        async with repo_lock(common):
            if self.root is None:
                exclude_shoal(common)  # before the status below: earlier worktrees are not changes
            if not self.allow_dirty:
                dirty = [ln for ln in await status_lines(top) if not ln[3:].startswith(".shoal/")]
                if dirty:
                    raise DirtyBase(f"{top} has {len(dirty)} uncommitted change(s) (e.g. {dirty[0][3:]!r}); a worktree "
                                    f"starts from {self.base} and would not have them. Commit or stash them, "
                                    f"or pass allow_dirty=True.")
            branch, path = await self._free_name(top, root)
            root.mkdir(parents=True, exist_ok=True)
            try:
                await git(top, "worktree", "add", "--quiet", "-b", branch, str(path), commit)
            except BaseException:
                # nothing half-made is left: no directory, no worktree entry, no branch
                await asyncio.to_thread(shutil.rmtree, path, True)
                await git(top, "worktree", "prune", check=False)
                await git(top, "branch", "-D", branch, check=False)
                raise
        self.path, self.branch, self.base_commit = path, branch, commit
        registry.add(self.id, self.kind, path, repo=str(top), branch=branch, base=commit)
        return path

    async def _free_name(self, top: Path, root: Path) -> tuple[str, Path]:
        taken = set((await git(top, "for-each-ref", "--format=%(refname:short)", "refs/heads/shoal/")).split())
        n = 1
        while True:
            name = self.task if n == 1 else f"{self.task}-{n}"
            branch, path = f"shoal/{name}", root / name
            if branch not in taken and not path.exists():
                return branch, path
            n += 1

    def env(self) -> dict[str, str]:
        return {}

    async def after_turn(self) -> None:
        return None

    async def close(self) -> str | None:
        if self.path is None or self.repo is None or self.branch is None:
            return None
        path, repo, branch = self.path, self.repo, self.branch
        dirty, commits = await holds_work(repo, path, branch)
        if self.keep == "always" or (self.keep == "changed" and (dirty or commits)):
            registry.update(self.id, status="kept", holds=what(dirty, commits))
            return f"kept worktree {path} on branch {branch} ({what(dirty, commits)})"
        await remove(repo, path, branch, force=self.keep == "never")
        registry.remove(self.id)
        self.path = None
        return None

    def diffstat(self) -> str:
        """What the branch holds against where it started, for review: `git diff --shortstat`
        of the worktree (commits and uncommitted edits) plus untracked files."""
        if self.path is None or not self.path.exists():
            return ""

        def run(*args: str) -> str:
            out = subprocess.run(["git", "-C", str(self.path), *args], capture_output=True, text=True, timeout=60)
            return out.stdout.strip()
        stat = run("diff", "--shortstat", self.base_commit or self.base)
        untracked = [f for f in run("ls-files", "--others", "--exclude-standard").splitlines() if f]
        parts = [stat] if stat else []
        if untracked:
            parts.append(f"{len(untracked)} untracked ({', '.join(untracked[:3])})")
        return "; ".join(parts)

    def describe(self) -> str:
        return f"worktree {self.path} ({self.branch})" if self.path else f"worktree of {self.repo_arg} ({self.task})"


def exclude_shoal(common: Path) -> None:
    """Add `.shoal/` to the repo's own exclude file (not .gitignore: nothing of the user's changes)."""
    exclude = common / "info" / "exclude"
    text = exclude.read_text() if exclude.exists() else ""
    if ".shoal/" not in text.split():
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + ".shoal/\n")


async def remove(repo: Path, path: Path, branch: str, *, force: bool = False) -> None:
    common = Path((await git(repo, "rev-parse", "--path-format=absolute", "--git-common-dir")).strip())
    async with repo_lock(common):
        if path.exists():
            await git(repo, "worktree", "remove", *(["--force", "--force"] if force else []), str(path))
        else:
            await git(repo, "worktree", "prune", check=False)
        await git(repo, "branch", "-D", branch, check=False)


async def clean(entry: registry.Entry) -> tuple[bool, str]:
    """`shoal places clean`: remove a worktree only if it holds nothing new. (removed?, why)"""
    repo, path, branch = Path(entry["repo"]), Path(entry["path"]), str(entry["branch"])
    if not repo.is_dir():
        return False, f"its repository {repo} is gone; left as it is"
    dirty, commits = await holds_work(repo, path, branch)
    if dirty or commits:
        return False, f"holds work: {what(dirty, commits)} (commit/merge it, or remove it with `git worktree remove`)"
    await remove(repo, path, branch)
    return True, "removed (nothing new in it)"


async def holds(entry: registry.Entry) -> str:
    repo, path = Path(entry["repo"]), Path(entry["path"])
    if not path.exists():
        return "directory gone"
    dirty, commits = await holds_work(repo, path, str(entry["branch"]))
    return f"branch {entry['branch']}: {what(dirty, commits)}"
