"""The shell shim's own rules: which argv is a command, where it runs, what stays here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from places_env import processes_running, sleeper, wait_until
from shoal.places import shim, short


def test_parse_the_shapes_the_clis_use() -> None:
    assert shim.parse(["-c", "ls"]) == ("ls", [])  # opencode
    assert shim.parse(["-c", "-l", "ls"]) == ("ls", [])  # Claude Code
    assert shim.parse(["-lc", "ls", "/bin/bash"]) == ("ls", ["/bin/bash"])  # codex, with $0
    assert shim.parse(["--login", "-o", "pipefail", "-c", "ls", "a0", "a1"]) == ("ls", ["a0", "a1"])
    assert shim.parse(["script.sh"]) == (None, [])
    assert shim.parse(["-i"]) == (None, [])


def test_where_a_directory_lands() -> None:
    assert shim.remote_dir("/m/x", "/m/x", "/srv/p") == "/srv/p"
    assert shim.remote_dir("/m/x/sub/dir", "/m/x", "/srv/p") == "/srv/p/sub/dir"
    assert shim.remote_dir("/m/xy", "/m/x", "/srv/p") == "/srv/p"  # not inside: the root
    assert shim.remote_dir("/tmp", "/m/x", "/srv/p") == "/srv/p"


def test_cli_housekeeping_stays_here() -> None:
    for command in ('SNAPSHOT_FILE=/h/.claude/shell-snapshots/s.sh\necho "# Snapshot file" >| "$SNAPSHOT_FILE"',
                    'set -e; . "/h/codex/shell_snapshots/x.tmp-1"',
                    '__CODEX_SNAPSHOT_OVERRIDE_SET_0="${X+x}"\nexec \'/bin/bash\' -c \'ls\''):
        assert shim.HOUSEKEEPING.search(command)
    assert not shim.HOUSEKEEPING.search("cat notes/a.txt && pytest -q")


def test_a_fake_target_gets_the_command_and_claude_s_cwd_file_is_written_here(tmp_path: Path) -> None:
    """The shim as written, against a 'target' that is a script printing what it was given."""
    target = tmp_path / "target"
    log = tmp_path / "target.log"
    target.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {log}\n")
    target.chmod(0o755)
    local, remote = tmp_path / "mnt", "/srv/project"
    (local / "sub").mkdir(parents=True)
    env = shim.write(tmp_path / "place", {"kind": "ssh", "shell": "/bin/bash", "bash": shim.local_bash(),
                                          "prefix": [str(target)], "local_root": str(local),
                                          "remote_root": remote}, "test")
    cwd_file = tmp_path / "claude-cwd"
    command = (f"source /h/.claude/shell-snapshots/s.sh 2>/dev/null || true && eval 'cat {local}/sub/f' "
               f"< /dev/null && pwd -P >| {cwd_file}")
    subprocess.run([env["SHELL"], "-c", command], cwd=local / "sub", check=True,
                   env={**os.environ, "PWD": str(local / "sub")})
    sent = log.read_text().splitlines()
    expected = (r"export SHOAL_PLACE_CMD=place\.\d+-[0-9a-f]{12} && cd -- /srv/project/sub && "
                r"exec /bin/bash --norc -c 'eval '\"'\"'cat /srv/project/sub/f'\"'\"' < /dev/null'")
    assert len(sent) == 1 and re.fullmatch(expected, sent[0]), sent
    assert cwd_file.read_text().strip() == str(local / "sub")  # here, where the CLI reads it

    # housekeeping runs here, in the real bash, and the BASH_ENV hook does not send it again
    out = subprocess.run(["bash", "-c", 'echo "# Snapshot file"; echo $0'], cwd=local, capture_output=True,
                         text=True, env={**os.environ, **env}, check=True).stdout
    assert out.split("\n")[0] == "# Snapshot file"
    log.unlink()
    subprocess.run(["bash", "-c", "echo sent"], cwd=local, env={**os.environ, **env}, check=True)
    assert "exec /bin/bash --norc -c 'echo sent'" in log.read_text()  # plain bash lands through $BASH_ENV
    assert json.loads(json.dumps(env)) == env


# A target that is this machine reached like ssh: the "client" starts the remote command in a
# session of its own and waits for it; killed, it leaves that command running, as ssh does.
FAKE_SSH = ["/bin/sh", "-c", 'setsid sh -c "$1" & wait $!', "fake-ssh"]


def local_place(tmp_path: Path) -> tuple[dict[str, Any], dict[str, str], Path]:
    local = tmp_path / "mnt"
    local.mkdir()
    config: dict[str, Any] = {"kind": "ssh", "shell": "/bin/sh", "bash": shim.local_bash(), "prefix": FAKE_SSH,
                              "local_root": str(local), "remote_root": str(local)}
    env = shim.write(tmp_path / "place-1", config, "this machine")
    return config, {**os.environ, **env}, local


def started(command: str) -> bool:
    """Is the command itself running (not only the shim and the client naming it)?"""
    return any(p.split(": ", 1)[1].startswith(command) for p in processes_running(command))


def tokens(config: dict[str, Any], sub: str) -> list[str]:
    return os.listdir(Path(config["runs"]) / sub)


def test_output_and_exit_code_pass_through_and_the_command_is_tagged(tmp_path: Path) -> None:
    config, env, local = local_place(tmp_path)
    done = subprocess.run([env["SHELL"], "-c", "echo out; echo err >&2; echo $SHOAL_PLACE_CMD; exit 3"],
                          cwd=local, env=env, capture_output=True, text=True)
    assert done.returncode == 3 and done.stderr == "err\n"
    out, token = done.stdout.split()
    assert out == "out" and token.startswith("place-1.")
    assert tokens(config, "done") == [token] and tokens(config, "run") == []
    assert asyncio.run(short.end_turn(config)) is True  # the turn ran a command there
    assert tokens(config, "done") == [] and asyncio.run(short.end_turn(config)) is False


def test_a_stopped_shim_stops_its_command_in_the_target(tmp_path: Path) -> None:
    """opencode's way of stopping a tool: TERM to its process group, KILL 200 ms later."""
    config, env, local = local_place(tmp_path)
    command = sleeper()
    proc = subprocess.Popen([env["SHELL"], "-c", command], cwd=local, env=env, start_new_session=True)
    assert wait_until(lambda: started(command), 10)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not processes_running(command), 5), processes_running(command)
    assert len(tokens(config, "run")) == 1  # the turn's end sweeps it once more (it may have been starting)
    asyncio.run(short.end_turn(config))
    assert tokens(config, "run") == []


def test_the_end_of_a_turn_stops_what_a_killed_shim_left(tmp_path: Path) -> None:
    config, env, local = local_place(tmp_path)
    command = sleeper()
    proc = subprocess.Popen([env["SHELL"], "-c", command], cwd=local, env=env, start_new_session=True)
    assert wait_until(lambda: started(command), 10)
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to stop anything
    proc.wait()
    time.sleep(0.3)
    assert processes_running(command)  # the command runs on in the target
    assert len(tokens(config, "run")) == 1
    asyncio.run(short.end_turn(config))
    assert processes_running(command) == [] and tokens(config, "run") == []


def test_what_a_command_left_in_the_background(tmp_path: Path) -> None:
    """Left running after a turn that ended normally (until the place is given back); stopped
    when the turn is cancelled."""
    config, env, local = local_place(tmp_path)

    async def turn(cancel: bool) -> None:
        async def body() -> None:
            try:
                await asyncio.sleep(60 if cancel else 0)
            finally:
                await short.end_turn(config)

        task = asyncio.create_task(body())
        await asyncio.sleep(0.05)
        if cancel:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    for cancel in (False, True):
        command = sleeper()
        subprocess.run([env["SHELL"], "-c", f"{command} >/dev/null 2>&1 & echo started"], cwd=local, env=env,
                       check=True, capture_output=True)
        assert processes_running(command)
        asyncio.run(turn(cancel))
        if not cancel:
            assert processes_running(command)  # the agent's server, say, for the next turn
            assert asyncio.run(short.sweep(config)) is True  # what an ssh place does when given back
        assert processes_running(command) == [] and tokens(config, "done") == []


# A CLI with threads: it starts its command from a thread that ends a moment later (the kernel
# tells the shim, as if its CLI had died), and lives on until it is killed.
THREADED_CLI = """
import subprocess, sys, threading, time
def start():
    subprocess.Popen([sys.argv[1], "-c", sys.argv[2]])
    time.sleep(1)
threading.Thread(target=start).start()
time.sleep(600)
"""


def test_a_shim_whose_cli_dies_stops_its_command_in_the_target(tmp_path: Path) -> None:
    """shoal killed outright: the CLI dies with it (PR_SET_PDEATHSIG), the shim's client does not
    (the fake one here never does), and nothing is left to sweep at the turn's end. The kernel
    tells the shim its CLI died; the end of a thread of the CLI alone stops nothing."""
    _config, env, local = local_place(tmp_path)
    command = sleeper()
    cli = subprocess.Popen([sys.executable, "-c", THREADED_CLI, env["SHELL"], command], cwd=local, env=env,
                           start_new_session=True)
    try:
        assert wait_until(lambda: started(command), 10)
        time.sleep(1.3)  # the thread that started the shim has ended
        assert started(command)
    finally:
        cli.kill()  # the CLI alone: the shim and its client run on, orphaned
        cli.wait()
    assert wait_until(lambda: not processes_running(command), 5), processes_running(command)
