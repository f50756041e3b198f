"""A container apiece, real engines: commands land in the container, the work stays in the project.

Each test runs against podman and against docker (a private dockerd the session starts, see
places_env.py). The image is a busybox root filesystem built by the fixture holding a marker
file that only the image has. Every test checks that no container shoal made is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import shoal
from conftest import leftovers, make_agent, stray
from places_env import (  # noqa: F401 - fixtures
    MARKER,
    Engine,
    dockerd,
    engine,
    git,
    need,
    podman_image,
    processes_running,
    repo,
    shoal_home,
    sleeper,
    wait_until,
)
from shoal.cli.main import main as shoal_cli
from shoal.places import registry


def test_commands_land_in_the_container(backend: str, engine: Engine, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    tag = f"{os.getpid()}-{time.time_ns()}"
    outside = Path(f"/tmp/shoal-made-in-container-{tag}")
    # the container is the boundary here: commands may touch its /tmp
    with make_agent(backend, permissions={"external_directory": "allow"}) as agent:
        place = shoal.Container(engine.image, path=project, engine=engine.name, network="none")
        s = agent.session(where=place)
        r = s.run(f"#! write notes/a.txt hello\n#! run cat /etc/shoal-marker > seen.txt && id -u >> seen.txt && "
                  f"id -g >> seen.txt && touch {outside} && ls {outside} >> seen.txt && cat notes/a.txt >> seen.txt")
        assert s.cwd == str(project)  # the project itself is mounted at its own path
        assert engine.containers(f"shoal.place={place.id}") == [place.name]
        assert r.tool_calls and all(t.ok for t in r.tool_calls), [(t.input, t.output) for t in r.tool_calls]
    seen = (project / "seen.txt").read_text().split()
    assert seen == [MARKER, str(os.getuid()), str(os.getgid()), str(outside), "hello"]
    assert not outside.exists()  # made in the container's /tmp, not here
    assert (project / "seen.txt").stat().st_uid == os.getuid()  # the work is the caller's
    assert engine.containers(f"shoal.place={place.id}") == []  # taken down with the agent
    assert leftovers(agent.id) == [] and registry.entries() == [] and agent.kept == []


def in_container(engine: Engine, name: str, command: str) -> bool:
    ps = engine.run("exec", name, "ps", "-o", "args").stdout
    return any(line.startswith(command) for line in ps.splitlines())


@pytest.mark.parametrize("backend", ["opencode", "opencode:run", "claude", "codex"])
def test_a_cancelled_turn_stops_its_command_in_the_container(backend: str, engine: Engine,
                                                            tmp_path: Path) -> None:
    """The CLI's shell command runs in the container: cancelling the turn stops it there too,
    at once, not when the container goes (opencode kills the tool; `opencode run` is stopped)."""
    project = tmp_path / "project"
    project.mkdir()
    command = sleeper()
    with make_agent(backend) as agent:
        place = shoal.Container(engine.image, path=project, engine=engine.name, network="none")
        s = agent.session(where=place)

        async def cancelled() -> None:
            turn = asyncio.create_task(s.arun(f"#! run echo started > started.txt && {command}"))
            try:
                assert await asyncio.to_thread(wait_until, lambda: in_container(engine, place.name, command), 90)
            finally:
                turn.cancel()
            with pytest.raises(asyncio.CancelledError):
                await turn

        asyncio.run(cancelled())
        assert (project / "started.txt").read_text() == "started\n"
        # gone from the container and from here (the shim, the engine's client), the container still up
        assert wait_until(lambda: not processes_running(command), 5), processes_running(command)
        assert not in_container(engine, place.name, command)
        assert engine.containers(f"shoal.place={place.id}") == [place.name]
        assert stray(agent) == []
    assert leftovers(agent.id) == [] and engine.containers() == [] and registry.entries() == []


def test_the_turn_end_stops_what_a_killed_shim_left_in_the_container(engine: Engine, tmp_path: Path) -> None:
    """A shim killed outright (SIGKILL: it cannot stop its command) leaves the command running in
    the container; the place's after_turn finds it there by its token and stops it. No signal
    reaches it any other way (`docker exec` passes none on), so only the sweep can."""
    place = shoal.Container(engine.image, path=tmp_path, engine=engine.name, network="none")
    command = sleeper()

    async def main() -> None:
        await place.open()
        try:
            env = {**os.environ, **place.env()}
            shim = subprocess.Popen([place.env()["SHELL"], "-c", f"echo x; {command}"], cwd=tmp_path, env=env,
                                    stdout=subprocess.DEVNULL, start_new_session=True)
            assert await asyncio.to_thread(wait_until, lambda: in_container(engine, place.name, command), 30)
            os.killpg(shim.pid, signal.SIGKILL)
            shim.wait()
            await asyncio.sleep(0.5)
            assert in_container(engine, place.name, command)  # the engine's client went; the command did not
            await place.after_turn()
            assert not in_container(engine, place.name, command)
            assert engine.containers(f"shoal.place={place.id}") == [place.name]
        finally:
            await place.close()

    asyncio.run(main())
    assert not processes_running(command) and engine.containers() == [] and registry.entries() == []


def test_no_container_outlives_a_killed_shoal(engine: Engine, tmp_path: Path) -> None:
    """The container's main process waits on a pipe shoal holds: SIGKILL shoal and it goes."""
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys, shoal
        async def main():
            place = shoal.Container({engine.image!r}, path={str(tmp_path)!r}, engine={engine.name!r},
                                    network="none")
            await place.open()
            print(place.name, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name in engine.containers()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while name in engine.containers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert name not in engine.containers()
    # what the killed process had registered is cleaned up by `shoal places clean`
    assert len(registry.entries()) == 1 and not registry.in_use(registry.entries()[0])
    assert shoal_cli(["places", "clean"]) == 0
    assert registry.entries() == []


def test_many_containers_at_once(engine: Engine, tmp_path: Path) -> None:
    places = [shoal.Container(engine.image, path=tmp_path, engine=engine.name, network="none") for _ in range(4)]

    async def main() -> float:
        started = time.monotonic()
        await asyncio.gather(*(p.open() for p in places))
        up = time.monotonic() - started
        assert sorted(engine.containers()) == sorted(p.name for p in places)
        await asyncio.gather(*(p.close() for p in places))
        return up

    up = asyncio.run(main())
    assert engine.containers() == [] and registry.entries() == []
    assert up < 60


def test_bad_input(engine: Engine, tmp_path: Path) -> None:
    before = engine.containers()
    with shoal.Agent("opencode") as agent:
        with pytest.raises(shoal.EngineNotFound, match="not installed"):
            agent.session(where=shoal.Container(engine.image, engine="no-such-engine"))
        with pytest.raises(shoal.PlaceError, match="not a directory"):
            agent.session(where=shoal.Container(engine.image, path=tmp_path / "missing", engine=engine.name))

    missing = shoal.Container("localhost/shoal-no-such-image:1", path=tmp_path, engine=engine.name)
    started = time.monotonic()
    with pytest.raises(shoal.ImageNotFound, match=f"not in {engine.name}'s local store") as error:
        asyncio.run(missing.open())
    assert "no such image" in str(error.value).lower() or "image not known" in str(error.value)
    assert time.monotonic() - started < 30
    assert engine.containers() == before and registry.entries() == [] and not registry.place_dir(missing.id).exists()


def test_docker_without_an_engine_is_a_clear_error(tmp_path: Path) -> None:
    need("docker")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0:
        pytest.skip("docker has an engine here; this test is about a client with none")
    place = shoal.Container("busybox", path=tmp_path, engine="docker")
    started = time.monotonic()
    with pytest.raises(shoal.EngineNotFound, match="cannot reach its engine"):
        asyncio.run(place.open())
    assert time.monotonic() - started < 30 and registry.entries() == []


def test_a_worktree_apiece_inside_a_container_apiece(engine: Engine, repo: Path) -> None:
    """Places compose: the container mounts the worktree; both the shim (as $SHELL) and plain
    bash (through $BASH_ENV, how codex's commands land) run there."""
    place = shoal.Container(engine.image, path=shoal.Worktree(repo, task="boxed"), engine=engine.name,
                            network="none")

    async def main() -> tuple[Path, str | None]:
        path = await place.open()
        env = {**os.environ, **place.env()}
        for shell, out in ((place.env()["SHELL"], "a.txt"), ("bash", "b.txt")):
            subprocess.run([shell, "-c", f"cat /etc/shoal-marker > {out} && test ! -e {repo}/README"],
                           cwd=path, env=env, check=True)
        # git can work in there (this image has none): the repository's .git is mounted too
        subprocess.run([place.env()["SHELL"], "-c", f"test -f {repo}/.git/worktrees/boxed/HEAD"],
                       cwd=path, env=env, check=True)
        return path, await place.close()

    path, note = asyncio.run(main())
    assert path == repo / ".shoal" / "worktrees" / "boxed"
    assert (path / "a.txt").read_text().strip() == MARKER and (path / "b.txt").read_text().strip() == MARKER
    assert note and "kept worktree" in note and "2 uncommitted change(s)" in note  # never lose work
    assert engine.containers() == []
