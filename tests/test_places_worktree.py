"""A worktree apiece, real git: branch per task, many at once, never losing work, `shoal places`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shoal
from conftest import leftovers, make_agent
from places_env import git, repo, shoal_home  # noqa: F401 - fixtures
from shoal.cli.main import main as shoal_cli
from shoal.places import registry


def branches(r: Path) -> list[str]:
    return git(r, "for-each-ref", "--format=%(refname:short)", "refs/heads/shoal/").split()


def worktrees(r: Path) -> list[str]:
    return [line.split()[1] for line in git(r, "worktree", "list", "--porcelain").splitlines()
            if line.startswith("worktree ")][1:]


def test_a_turn_works_in_its_own_worktree_and_the_work_is_kept(backend: str, repo: Path) -> None:
    if ":" in backend:
        pytest.skip("a local place is the same to every transport; one per CLI is enough")
    with make_agent(backend) as agent:
        s = agent.session(where=shoal.Worktree(repo, task="fix parser"))
        s.run("#! write parser.txt fixed\n#! run git add parser.txt && git commit -qm fix")
        wt = Path(str(s.cwd))
        assert wt == repo / ".shoal" / "worktrees" / "fix-parser"
        assert git(wt, "branch", "--show-current").strip() == "shoal/fix-parser"
        assert not (repo / "parser.txt").exists()  # the main checkout is untouched
    assert leftovers(agent.id) == []
    # the commit is on no other branch: kept, and the end of the run says where
    assert len(agent.kept) == 1 and str(wt) in agent.kept[0] and "1 commit(s) on no other branch" in agent.kept[0]
    assert (wt / "parser.txt").read_text().strip() == "fixed"
    assert git(repo, "status", "--porcelain") == ""  # .shoal/ is excluded: the user's status stays clean


def test_many_worktrees_at_once_on_one_repo(repo: Path) -> None:
    places = [shoal.Worktree(repo, task="fix-parser") for _ in range(12)]

    async def main() -> list[Path]:
        paths = await asyncio.gather(*(p.open() for p in places))
        notes = await asyncio.gather(*(p.close() for p in places))
        assert notes == [None] * 12  # nothing new in any of them: all removed
        return paths

    paths = asyncio.run(main())
    names = sorted(p.name for p in paths)
    assert names == sorted(["fix-parser"] + [f"fix-parser-{i}" for i in range(2, 13)])
    assert branches(repo) == [] and worktrees(repo) == [] and registry.entries() == []


def test_worktrees_from_several_processes_at_once(repo: Path, tmp_path: Path) -> None:
    """git's own locks collide across processes too: the flock serialises them."""
    script = tmp_path / "open.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, shoal
        async def main():
            places = [shoal.Worktree({str(repo)!r}, task="shared") for _ in range(4)]
            await asyncio.gather(*(p.open() for p in places))
            print(" ".join(p.branch for p in places))
        asyncio.run(main())
    """))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    made = sorted(b for out, _ in outs for b in out.split())
    assert len(made) == 12 and len(set(made)) == 12 and sorted(branches(repo)) == made
    assert len(worktrees(repo)) == 12


def test_never_lose_work_and_shoal_places(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirty, committed, clean = (shoal.Worktree(repo, task=t) for t in ("dirty", "committed", "clean"))

    async def work() -> list[str | None]:
        for p in (dirty, committed, clean):
            await p.open()
        assert dirty.path and committed.path
        (dirty.path / "notes.txt").write_text("draft\n")
        (committed.path / "done.txt").write_text("done\n")
        git(committed.path, "add", "done.txt")
        git(committed.path, "commit", "-qm", "done")
        return [await p.close() for p in (dirty, committed, clean)]

    notes = asyncio.run(work())
    assert notes[0] and "1 uncommitted change(s)" in notes[0] and str(dirty.path) in notes[0]
    assert notes[1] and "1 commit(s) on no other branch" in notes[1] and "shoal/committed" in notes[1]
    assert notes[2] is None and not (repo / ".shoal" / "worktrees" / "clean").exists()
    assert branches(repo) == ["shoal/committed", "shoal/dirty"]

    assert shoal_cli(["places"]) == 0
    listed = capsys.readouterr().out
    assert "uncommitted" in listed and "1 commit(s) on no other branch" in listed and "clean" not in listed

    assert shoal_cli(["places", "clean"]) == 0
    out = capsys.readouterr().out
    assert out.count("kept") >= 2 and "0 removed, 2 kept" in out
    assert dirty.path and dirty.path.exists() and committed.path and committed.path.exists()

    # once the work is somewhere else (merged, or thrown away by hand), clean removes them
    git(repo, "merge", "-q", "--ff-only", "shoal/committed")
    (dirty.path / "notes.txt").unlink()
    assert shoal_cli(["places", "clean"]) == 0
    assert "2 removed, 0 kept" in capsys.readouterr().out
    assert branches(repo) == [] and worktrees(repo) == [] and registry.entries() == []
    assert (repo / "done.txt").exists()  # the merged work is where it was merged to


def test_a_worktree_in_use_is_not_cleaned(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    place = shoal.Worktree(repo, task="busy")
    asyncio.run(place.open())
    assert shoal_cli(["places", "clean"]) == 0
    assert "in use by a running shoal" in capsys.readouterr().out
    assert place.path and place.path.exists()
    assert asyncio.run(place.close()) is None


def test_bad_input(repo: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with shoal.Agent("opencode") as agent:
        with pytest.raises(shoal.NotAGitRepo, match="not inside a git repository"):
            agent.session(where=shoal.Worktree(plain))
        with pytest.raises(shoal.NotAGitRepo, match="no such directory"):
            agent.session(where=shoal.Worktree(tmp_path / "missing"))

    (repo / "README").write_text("changed\n")
    with pytest.raises(shoal.DirtyBase, match="allow_dirty=True"):
        asyncio.run(shoal.Worktree(repo, task="t").open())
    assert branches(repo) == [] and worktrees(repo) == [] and registry.entries() == []  # nothing half-made

    with pytest.raises(shoal.PlaceError, match="no such commit"):
        asyncio.run(shoal.Worktree(repo, task="t", base="no-such-ref", allow_dirty=True).open())
    assert branches(repo) == [] and worktrees(repo) == []

    allowed = shoal.Worktree(repo, task="t", allow_dirty=True)
    path = asyncio.run(allowed.open())
    assert (path / "README").read_text() == "hello\n"  # from the base commit, not the dirty checkout
    assert asyncio.run(allowed.close()) is None


def test_what_counts_as_work_on_a_branch(repo: Path) -> None:
    """The check that decides deletion: commits on no other branch, tag or remote branch."""
    from shoal.places.worktree import unique_commits

    def count(branch: str) -> int:
        return asyncio.run(unique_commits(repo, branch))

    git(repo, "branch", "shoal/a")
    assert count("shoal/a") == 0  # at main's commit
    git(repo, "checkout", "-q", "shoal/a")
    (repo / "x").write_text("x\n")
    git(repo, "add", "x")
    git(repo, "commit", "-qm", "x")
    git(repo, "checkout", "-q", "main")
    assert count("shoal/a") == 1
    git(repo, "tag", "t1", "shoal/a")
    assert count("shoal/a") == 0  # tagged: kept by the tag
    git(repo, "tag", "-d", "t1")
    git(repo, "update-ref", "refs/remotes/origin/a", "shoal/a")
    assert count("shoal/a") == 0  # pushed
    git(repo, "update-ref", "-d", "refs/remotes/origin/a")
    git(repo, "branch", "other", "shoal/a")
    assert count("shoal/a") == 0  # on another branch
    assert count("shoal/missing") == 0
