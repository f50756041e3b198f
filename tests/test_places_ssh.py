"""An ssh target, real sshd on 127.0.0.1: the agent stays here; its commands and edits land there.

`sshd` (places_env.py) sets SHOAL_TEST_REMOTE in every session it serves, so a command that
can read it ran through that sshd and nowhere else. Every test checks that no mount, process
or private directory of the place is left behind.
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
from places_env import Sshd, fuse_mounts, processes_running, shoal_home, sleeper, sshd, wait_until  # noqa: F401
from shoal.cli.main import main as shoal_cli
from shoal.places import registry, shim


def place_processes(place: shoal.SSH) -> list[int]:
    """ssh/sshfs processes still naming this place's connection (its id is in their arguments)."""
    found = subprocess.run(["pgrep", "-f", place.id], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def started(command: str) -> bool:
    """Is the command itself running on the remote (not only the shim and the ssh client naming it)?"""
    return any(p.split(": ", 1)[1].startswith(command) for p in processes_running(command))


def remote_dir(tmp_path: Path) -> Path:
    d = tmp_path / "remote"
    d.mkdir()
    (d / "marker.txt").write_text("only-on-the-remote\n")
    return d


def test_commands_and_edits_land_on_the_remote(backend: str, sshd: Sshd, tmp_path: Path) -> None:
    remote = remote_dir(tmp_path)
    with make_agent(backend) as agent:
        place = shoal.SSH(sshd.target(remote), port=sshd.port, key=sshd.key, known_hosts=sshd.known_hosts)
        s = agent.session(where=place)
        r = s.run("#! write notes/w.txt written-here-landed-there\n"
                  "#! run cat marker.txt > seen.txt && echo $SHOAL_TEST_REMOTE >> seen.txt && pwd -P >> seen.txt "
                  "&& cat notes/w.txt >> seen.txt")
        assert r.tool_calls and all(t.ok for t in r.tool_calls), [(t.input, t.output) for t in r.tool_calls]
        local = Path(str(s.cwd))
        assert local != remote and str(local) in fuse_mounts()  # the CLI works here, on a mount of there
    # the write (the CLI's own tool) and the command's output are in the remote directory
    assert (remote / "notes" / "w.txt").read_text().strip() == "written-here-landed-there"
    seen = (remote / "seen.txt").read_text().split()
    assert seen == ["only-on-the-remote", sshd.env_marker, str(remote.resolve()), "written-here-landed-there"]
    # nothing of the work is left here: no mount, no private directory, no process
    assert str(local) not in fuse_mounts() and not registry.place_dir(place.id).exists()
    assert leftovers(agent.id) == [] and place_processes(place) == []
    assert registry.entries() == [] and agent.kept == []


def test_a_timed_out_turn_stops_its_command_on_the_remote(sshd: Sshd, tmp_path: Path) -> None:
    """ssh stops nothing on the remote when its client is killed: the shim does, over the held
    connection. The sshd here is this machine's, so its processes are in our /proc."""
    remote = remote_dir(tmp_path)
    command = sleeper()
    with make_agent("opencode") as agent:
        place = shoal.SSH(sshd.target(remote), port=sshd.port, key=sshd.key, known_hosts=sshd.known_hosts)
        s = agent.session(where=place)
        s.run("#! say ready")  # the place made and the CLI up: the timeout below is the command's alone
        with pytest.raises(shoal.TurnTimeout):
            s.run(f"#! run echo started > started.txt && {command}", timeout=5)
        assert (remote / "started.txt").read_text() == "started\n"
        assert wait_until(lambda: not processes_running(command), 5), processes_running(command)
        assert str(s.cwd) in fuse_mounts() and stray(agent) == []  # stopped while the place is still up
        assert s.run("#! run cat marker.txt").tool_calls[0].ok  # and the place still works
    assert leftovers(agent.id) == [] and place_processes(place) == [] and registry.entries() == []


def test_bad_input(sshd: Sshd, tmp_path: Path) -> None:
    remote = remote_dir(tmp_path)
    mounts = fuse_mounts()

    def refused(place: shoal.SSH, error: type[shoal.PlaceError], match: str) -> None:
        started = time.monotonic()
        with pytest.raises(error, match=match):
            asyncio.run(place.open())
        assert time.monotonic() - started < place.connect_timeout + 15
        # nothing half-made: no mount, no directory, no process, nothing registered
        assert fuse_mounts() == mounts and not registry.place_dir(place.id).exists()
        assert place_processes(place) == [] and registry.entries() == []

    with socket_closed() as port:
        refused(shoal.SSH(sshd.target(remote), port=port, key=sshd.key, known_hosts=sshd.known_hosts),
                shoal.HostUnreachable, "cannot reach")
    other = tmp_path / "other-key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    refused(shoal.SSH(sshd.target(remote), port=sshd.port, key=other, known_hosts=sshd.known_hosts),
            shoal.KeyRefused, "refused the key")
    refused(shoal.SSH(sshd.target(tmp_path / "no-such-dir"), port=sshd.port, key=sshd.key,
                      known_hosts=sshd.known_hosts), shoal.PlaceError, "cannot be used")
    with shoal.Agent("opencode") as agent, pytest.raises(shoal.KeyRefused, match="does not exist"):
        agent.session(where=shoal.SSH(sshd.target(remote), key=tmp_path / "no-such-key"))


class socket_closed:
    """A port on 127.0.0.1 with nothing listening (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


def test_nothing_outlives_a_killed_shoal(sshd: Sshd, tmp_path: Path) -> None:
    """SIGKILL the process holding an ssh place: its ssh, its sshfs and its mount all go."""
    remote = remote_dir(tmp_path)
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, shoal
        async def main():
            place = shoal.SSH({sshd.target(remote)!r}, port={sshd.port}, key={str(sshd.key)!r},
                              known_hosts={str(sshd.known_hosts)!r})
            await place.open()
            print(place.id, place.mount, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ})
    assert proc.stdout is not None
    place_id, mount = proc.stdout.readline().split()
    assert mount in fuse_mounts() and subprocess.run(["pgrep", "-f", place_id], capture_output=True).stdout
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 15
    while (mount in fuse_mounts() or subprocess.run(["pgrep", "-f", place_id], capture_output=True).stdout) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mount not in fuse_mounts()
    assert subprocess.run(["pgrep", "-f", place_id], capture_output=True, text=True).stdout == ""
    # what the killed process had registered is cleaned up by `shoal places clean`
    assert [e["id"] for e in registry.entries()] == [place_id] and not registry.in_use(registry.entries()[0])
    assert shoal_cli(["places", "clean"]) == 0
    assert registry.entries() == [] and not registry.place_dir(place_id).exists()


RUNNER = """
import shoal, sys, time
port, key, known_hosts, target, command = sys.argv[1:]
place = shoal.SSH(target, port=int(port), key=key, known_hosts=known_hosts)
with shoal.Agent("opencode") as agent:
    s = agent.session(where=place)
    print(agent.id, place.id, flush=True)
    r = s.run(f"#! run {command}", timeout=300)
    print("ended", all(t.ok for t in r.tool_calls), flush=True)
    time.sleep(600)
"""


def start_runner(sshd: Sshd, remote: Path, command: str) -> tuple[subprocess.Popen[str], str, str]:
    """A shoal in a process of its own running `command` on an ssh place: (it, agent id, place id)."""
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(sshd.port), str(sshd.key), str(sshd.known_hosts),
                             sshd.target(remote), command], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        agent_id, place_id = proc.stdout.readline().split()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, agent_id, place_id


def nothing_left_of_a_killed_shoal(command: str, mounts: list[str], agent_id: str, place_id: str) -> None:
    """After SIGKILL of the shoal holding an ssh place: its command, mount, CLI and ssh all gone."""
    assert wait_until(lambda: not processes_running(command), 10), processes_running(command)
    assert wait_until(lambda: not set(mounts) & set(fuse_mounts()), 10)
    assert leftovers(agent_id, settle=5) == []
    assert wait_until(lambda: not subprocess.run(["pgrep", "-f", place_id], capture_output=True).stdout, 5)
    assert shoal_cli(["places", "clean"]) == 0 and registry.entries() == []


def test_a_killed_shoal_leaves_no_command_running_on_the_remote(sshd: Sshd, tmp_path: Path) -> None:
    """SIGKILL shoal mid-turn (the python process alone): the CLI dies with it (PDEATHSIG), and so
    does the held connection. The shim, orphaned, stops its command on the remote through a
    connection of its own: told by the kernel that its CLI died, or seeing its ssh client end
    with the held connection (whichever comes first; here, usually the latter)."""
    remote = remote_dir(tmp_path)
    command = sleeper()
    proc, agent_id, place_id = start_runner(sshd, remote, command)
    try:
        # the command itself runs on the remote (not only the shim and its ssh naming it)
        assert wait_until(lambda: started(command), 60), processes_running(command)
        mounts = [m for m in fuse_mounts() if place_id in m]
        assert mounts
    finally:
        proc.kill()
        proc.wait()
    nothing_left_of_a_killed_shoal(command, mounts, agent_id, place_id)


def test_a_command_is_stopped_through_a_connection_of_its_own(sshd: Sshd, tmp_path: Path) -> None:
    """When the held connection cannot stop a command (it went with a killed shoal, or is going),
    the shim does it through a fresh one: the same port, key and known hosts, no ControlPath."""
    remote = remote_dir(tmp_path)
    place = shoal.SSH(sshd.target(remote), port=sshd.port, key=sshd.key, known_hosts=sshd.known_hosts)
    command = sleeper()

    async def main() -> None:
        await place.open()
        try:
            shell = subprocess.Popen([place.env()["SHELL"], "-c", command], cwd=place.mount,
                                     env={**os.environ, **place.env()}, start_new_session=True)
            assert await asyncio.to_thread(wait_until, lambda: started(command), 10)
            os.killpg(shell.pid, signal.SIGKILL)  # the shim and its client: the command runs on there
            shell.wait()
            [token] = os.listdir(Path(place._shim["runs"]) / "run")
            assert started(command)
            assert await asyncio.to_thread(shim.reap, {**place._shim, "prefix": ["false"]}, token)
            assert not processes_running(command)
        finally:
            await place.close()

    asyncio.run(main())
    assert place_processes(place) == [] and registry.entries() == []


def test_a_killed_shoal_leaves_no_background_command_on_the_remote(sshd: Sshd, tmp_path: Path) -> None:
    """What a turn that ended normally left in the background there (a server for the next turn)
    runs on while shoal lives; SIGKILL shoal between turns (the python process alone), and the
    place's lifeline, a remote process waiting on a pipe shoal held, sweeps it there."""
    remote = remote_dir(tmp_path)
    command = sleeper()
    proc, agent_id, place_id = start_runner(sshd, remote, f"nohup {command} </dev/null >/dev/null 2>&1 &")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["ended", "True"]  # the turn is over; its sleeper is not
        assert started(command), processes_running(command)
        mounts = [m for m in fuse_mounts() if place_id in m]
        assert mounts
    finally:
        proc.kill()
        proc.wait()
    nothing_left_of_a_killed_shoal(command, mounts, agent_id, place_id)


def test_giving_back_the_place_stops_what_commands_left_in_the_background(sshd: Sshd, tmp_path: Path) -> None:
    """close(): the lifeline, its stdin closed, stops the place's commands there and ends."""
    remote = remote_dir(tmp_path)
    place = shoal.SSH(sshd.target(remote), port=sshd.port, key=sshd.key, known_hosts=sshd.known_hosts)
    command = sleeper()

    async def main() -> float:
        await place.open()
        try:
            subprocess.run([place.env()["SHELL"], "-c", f"{command} </dev/null >/dev/null 2>&1 &"], cwd=place.mount,
                           env={**os.environ, **place.env()}, check=True, timeout=30)
            assert await asyncio.to_thread(wait_until, lambda: started(command), 10)
            assert await place.after_turn() is None and started(command)  # the turn ended normally: it runs on
        finally:
            began = time.monotonic()
            await place.close()
        return time.monotonic() - began

    assert asyncio.run(main()) < 2
    assert processes_running(command) == []
    assert place_processes(place) == [] and registry.entries() == []  # the lifeline too, here and there
