"""The shell shim's own rules: which argv is a command, where it runs, what stays here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from shoal.places import shim


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
    assert sent == ["cd -- /srv/project/sub && exec /bin/bash --norc -c 'eval '\"'\"'cat /srv/project/sub/f'\"'\"' "
                    "< /dev/null'"]
    assert cwd_file.read_text().strip() == str(local / "sub")  # here, where the CLI reads it

    # housekeeping runs here, in the real bash, and the BASH_ENV hook does not send it again
    out = subprocess.run(["bash", "-c", 'echo "# Snapshot file"; echo $0'], cwd=local, capture_output=True,
                         text=True, env={**os.environ, **env}, check=True).stdout
    assert out.split("\n")[0] == "# Snapshot file"
    log.unlink()
    subprocess.run(["bash", "-c", "echo sent"], cwd=local, env={**os.environ, **env}, check=True)
    assert "exec /bin/bash --norc -c 'echo sent'" in log.read_text()  # plain bash lands through $BASH_ENV
    assert json.loads(json.dumps(env)) == env
