"""A copy apiece: removed when it holds nothing new, kept (and listed) when it does."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import shoal
from conftest import leftovers, make_agent
from places_env import git, repo, shoal_home  # noqa: F401 - fixtures
from shoal.cli.main import main as shoal_cli
from shoal.places import registry


def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A = 1\n")
    (src / "README").write_text("hi\n")
    return src


def test_a_turn_in_a_copy_is_kept_and_the_source_untouched(backend: str, tmp_path: Path) -> None:
    if ":" in backend:
        pytest.skip("a local place is the same to every transport; one per CLI is enough")
    src = tree(tmp_path)
    with make_agent(backend) as agent:
        s = agent.session(where=shoal.Copy(src, root=tmp_path / "copies"))
        s.run("#! write pkg/b.py B = 2")
        copy = Path(str(s.cwd))
    assert leftovers(agent.id) == []
    assert not (src / "pkg" / "b.py").exists() and (copy / "pkg" / "b.py").exists()
    assert len(agent.kept) == 1 and str(copy) in agent.kept[0] and "1 changed file(s)" in agent.kept[0]
    assert [e["path"] for e in registry.entries()] == [str(copy)]


def test_unchanged_copies_go_changed_ones_stay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tree(tmp_path)
    same, edited, touched = (shoal.Copy(src, root=tmp_path / "copies") for _ in range(3))

    async def main() -> list[str | None]:
        for p in (same, edited, touched):
            await p.open()
        assert edited.path and touched.path
        (edited.path / "pkg" / "a.py").write_text("A = 2\n")  # same size, new content
        os.utime(touched.path / "README", ns=(1, 1))  # only the mtime moved: not work
        return [await p.close() for p in (same, edited, touched)]

    notes = asyncio.run(main())
    assert notes[0] is None and notes[2] is None and notes[1] and "1 changed file(s)" in notes[1]
    assert same.path and not same.path.exists() and touched.path and not touched.path.exists()
    assert edited.path and edited.path.exists()

    assert shoal_cli(["places", "clean"]) == 0
    assert "kept" in capsys.readouterr().out and edited.path.exists()
    (edited.path / "pkg" / "a.py").write_text("A = 1\n")  # the change undone: nothing to keep
    assert shoal_cli(["places", "clean"]) == 0
    assert "1 removed, 0 kept" in capsys.readouterr().out and not edited.path.exists()
    assert registry.entries() == []


def test_a_commit_in_a_copy_of_a_repo_is_work(repo: Path, tmp_path: Path) -> None:
    place = shoal.Copy(repo, root=tmp_path / "copies")

    async def main() -> str | None:
        path = await place.open()
        (path / "new.txt").write_text("n\n")
        git(path, "add", "new.txt")
        git(path, "commit", "-qm", "n")
        (path / "new.txt").unlink()
        git(path, "rm", "-q", "--cached", "new.txt")
        git(path, "commit", "-qm", "undo")  # the files are as they were; the history is not
        return await place.close()

    note = asyncio.run(main())
    assert note and "0 changed file(s), commits or refs its git history does not have" in note
    assert place.path and place.path.exists()


def test_never_means_never(tmp_path: Path) -> None:
    src = tree(tmp_path)
    place = shoal.Copy(src, keep="never", root=tmp_path / "copies")

    async def main() -> str | None:
        path = await place.open()
        (path / "x").write_text("x\n")
        return await place.close()

    assert asyncio.run(main()) is None and place.path and not place.path.exists() and registry.entries() == []


def test_bad_input(tmp_path: Path) -> None:
    with shoal.Agent("opencode") as agent, pytest.raises(shoal.PlaceError, match="not a directory"):
        agent.session(where=shoal.Copy(tmp_path / "missing"))
