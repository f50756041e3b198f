"""The shell a CLI runs its commands through when its session lands somewhere else.

A container or ssh place gives its session two things in the environment (`env()`):

- `SHELL` = a program named `bash` written into the place's own directory. opencode runs its
  bash tool as `$SHELL -c CMD`; Claude Code does too, but only for a shell named bash or zsh.
- `BASH_ENV` = a hook file. Codex ignores `$SHELL` (it takes the login shell from the passwd
  entry, /bin/bash here); bash reads `$BASH_ENV` before running `-c CMD`, and the hook hands
  `$BASH_EXECUTION_STRING` to the same program. Any CLI that runs commands through bash lands.

The program then runs CMD in the target: `<engine> exec` in the container, `ssh` over the
place's held connection into the remote directory. It is this module's source copied into the
place's directory with the place's settings appended, run by the same Python with `-I -S`, so
it starts in milliseconds and imports nothing of shoal.

Each command carries `SHOAL_PLACE_CMD=<token>` (`<place id>.<pid>-<random>`) in its environment
there, inherited by everything it starts, and its token is a file in the place's directory
(`runs/run/<token>`, moved to `runs/done/` once its main process ended). On SIGTERM, SIGINT or SIGHUP (a cancelled turn:
the CLI's process group stopped, opencode's kill of the tool's group), when its client
dies under it, and when its CLI dies (shoal killed outright: the CLI dies with shoal, and the
kernel tells the shim, `ORPHANED`), the shim stops every process there carrying the token —
from a process of its own session, which outlives a SIGKILL of the shim's group moments
later; over ssh through a connection of its own when the held one is gone (it goes with
shoal). A shim killed outright cannot; the place's `after_turn` sweeps what its tokens left
(`short.end_turn`). `<engine> exec` and `ssh` themselves stop nothing there when they are killed.

Commands a CLI runs for its own housekeeping (capturing or checking a snapshot of the local
shell's environment, which Claude Code and Codex do before the first command) stay here:
they describe the CLI's shell, and their files are written and read on this side.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# CLI housekeeping that must run next to the CLI (see the module docstring):
#   Claude Code: `SNAPSHOT_FILE=... ` creating its shell snapshot;
#   Codex: "# Snapshot file" creating one, ". .../shell_snapshots/..." checking it, and the
#   `__CODEX_SNAPSHOT_...` wrapper that ends by exec'ing bash -c CMD (which lands by itself).
HOUSEKEEPING = re.compile(r"SNAPSHOT_FILE=|__CODEX_SNAPSHOT_|# Snapshot file|/shell_snapshots/")
# Claude Code ends each command with `&& pwd -P >| /tmp/claude-XXXX-cwd` and reads that file
# here afterwards to follow `cd`. Run there, it would land in the target's /tmp; so the suffix
# is taken off and the file written here, with the directory the command ran in.
CWD_SUFFIX = re.compile(r"\s*&&\s*pwd -P >\| (?P<file>/\S+)\s*$")
# Claude Code starts each command by sourcing its snapshot of the local shell (a file here):
# `source FILE 2>/dev/null || true && ...`. In the target the file is not there, and a POSIX
# sh (dash, busybox) exits at once when `source`/`.` cannot read its file, `|| true` or not.
SOURCE_PREFIX = re.compile(r"^\s*(?:source|\.)\s+(?P<file>/\S+)\s+2>/dev/null\s*\|\|\s*true\s*&&\s*")
# what a command in the target sees of the CLI's environment (the target has its own tools/PATH)
FORWARD_ENV = ("TERM", "LANG", "LC_ALL", "TZ", "PAGER", "GIT_PAGER", "NO_COLOR", "FORCE_COLOR")
PASS = "SHOAL_SHIM_PASS"  # set when a command is run here: the hook must not send it again
TAG = "SHOAL_PLACE_CMD"  # in the environment of each command in the target: <place id>.<token>
REAP_TIMEOUT = 15.0
PR_SET_PDEATHSIG = 1
# What the kernel sends the shim when the thread of the CLI that started it ends (prctl
# PR_SET_PDEATHSIG). Not SIGTERM: the CLI's own TERM stops the command at once, while this
# one means the CLI is gone only if the shim's parent changed — a CLI with threads (a Rust or
# Bun runtime) may start the shim from a thread that ends before the CLI does.
ORPHANED = signal.SIGRTMIN + 3


def parse(args: list[str]) -> tuple[str | None, list[str]]:
    """(the -c command, its $0 and arguments) from a shell's argv; None when not `-c`."""
    c = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if a in ("--rcfile", "--init-file"):
            i += 2
            continue
        if a.startswith("--"):
            i += 1
            continue
        if len(a) > 1 and a[0] in "-+":
            c = c or (a[0] == "-" and "c" in a[1:])
            i += 2 if a[1:] in ("o", "O") else 1
            continue
        break
    if not c or i >= len(args):
        return None, []
    return args[i], args[i + 1:]


def remote_dir(cwd: str, local_root: str, remote_root: str) -> str:
    """Where `cwd` (here) is in the target; anything outside the place maps to its root."""
    root = local_root.rstrip("/")
    if cwd.startswith(root + "/"):
        return remote_root.rstrip("/") + cwd[len(root):]
    return remote_root


def target_argv(config: dict[str, Any], command: str, extra: list[str], wd: str, token: str) -> list[str]:
    shell = config["shell"]
    if config["kind"] == "container":
        env = [f"--env={k}={os.environ[k]}" for k in FORWARD_ENV if k in os.environ]
        return [*config["prefix"], "--workdir", wd, *env, f"--env={TAG}={token}", config["name"],
                shell, "-c", command, *extra]
    # ssh: the remote login shell reads one string; cd there, then the same shell as here.
    # The login shell has already read the user's startup files (their PATH and such, which
    # the command keeps); --norc stops bash reading ~/.bashrc again because it runs under sshd.
    norc = " --norc" if os.path.basename(shell) == "bash" else ""
    remote = (f"export {TAG}={shlex.quote(token)} && cd -- {shlex.quote(wd)} && "
              f"exec {shlex.quote(shell)}{norc} -c {shlex.quote(command)}")
    if extra:
        remote += " " + " ".join(shlex.quote(a) for a in extra)
    return [*config["prefix"], remote]


def _literal(text: str) -> str:
    """`text` as a basic regular expression matching itself."""
    return "".join(c if c.isalnum() or c in "_-=/:@%," else "\\^" if c == "^" else f"[{c}]" for c in text)


def sweep_script(patterns: list[str]) -> str:
    """POSIX sh for the target: stop every process whose environment holds `SHOAL_PLACE_CMD=`
    followed by one of `patterns` (a whole token, or `<place id>.` for all of a place's): TERM,
    up to 1 s to go, then KILL. It reads /proc (a Linux target); elsewhere it finds nothing.
    The patterns are regular expressions, not `grep -F`: busybox's fixed-string search stops at
    the first NUL of a /proc/PID/environ, so it saw only the first variable: which one that is
    depends on the engine and the shell (podman's order happened to put the tag first, docker's not)."""
    grep = " ".join(f"-e {shlex.quote(_literal(f'{TAG}={p}'))}" for p in patterns)
    return (f"p() {{ for f in $(grep -l {grep} /proc/[0-9]*/environ 2>/dev/null); do f=${{f#/proc/}}; "
            "echo ${f%/environ}; done; }; "
            'l=$(p); [ -z "$l" ] && exit 0; kill -TERM $l 2>/dev/null; '
            'for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.1; l=$(p); [ -z "$l" ] && exit 0; done; '
            "kill -KILL $l 2>/dev/null; exit 0")


LIFELINE_UP = "shoal-lifeline-up"


def lifeline_script(place_id: str) -> str:
    """POSIX sh for an ssh target, run there over the place's held connection while the place is
    open (ssh.py): say it is up, wait for its stdin to end, then stop every command of the place
    (`sweep_script`). Its stdin is a pipe that shoal holds and never writes to: it ends when the
    place is given back, when shoal dies however it dies, and when the connection drops. HUP and
    PIPE are ignored: the sweep runs with the channel gone (OpenSSH sends no HUP without a tty)."""
    return f"trap '' HUP PIPE; echo {LIFELINE_UP}; cat >/dev/null; {sweep_script([f'{place_id}.'])}"


def sweep_argv(config: dict[str, Any], patterns: list[str], *, direct: bool = False) -> list[str]:
    """The command that runs `sweep_script` in the target, the way the shim reaches it; `direct`:
    over ssh, through a connection of its own (`config["direct"]`), not the held one."""
    script = sweep_script(patterns)
    if config["kind"] == "container":
        return [*config["prefix"], config["name"], "sh", "-c", script]
    return [*config["direct" if direct else "prefix"], f"sh -c {shlex.quote(script)}"]


def reap(config: dict[str, Any], token: str) -> bool:
    """Stop the command of `token` in the target, and all it started; True once done. The sweep
    runs in a session of its own: opencode kills a tool's process group 200 ms after its TERM.
    Over ssh, if the held connection fails it (it is gone, or going: shoal was killed), again
    through a connection of its own. Within REAP_TIMEOUT in all."""
    deadline = time.monotonic() + REAP_TIMEOUT
    for direct in (False, True) if config.get("direct") else (False,):
        try:
            proc = subprocess.Popen(sweep_argv(config, [token], direct=direct), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **config.get("env", {})})
        except OSError:
            return False
        try:
            code = proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False
        log(config, reap=token, direct=direct, code=code)
        if code == 0:
            return True
    return False


def arm_orphaned() -> bool:
    """Have the kernel send ORPHANED when the thread of the CLI that started this process ends
    (Linux; prctl through ctypes, this runs with the standard library only). False if it cannot."""
    try:
        import ctypes

        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, ORPHANED)) == 0
    except (ImportError, OSError, AttributeError):
        return False


def _move(src: Path, dst: Path | None) -> None:
    with contextlib.suppress(OSError):
        if dst is None:
            src.unlink()
        else:
            src.rename(dst)


def log(config: dict[str, Any], **fields: Any) -> None:
    """One JSON line per call when the place was made with $SHOAL_SHIM_LOG set (for debugging)."""
    if config.get("log"):
        with open(config["log"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


def run_here(config: dict[str, Any], args: list[str], command: str | None) -> None:
    log(config, here=args)
    env = dict(os.environ)
    env[PASS] = command or ""
    os.execve(config["bash"], [config["bash"], *args], env)


def main(config: dict[str, Any]) -> int:
    args = sys.argv[1:]
    command, extra = parse(args)
    if command is None or HOUSEKEEPING.search(command):
        run_here(config, args, command)
    assert command is not None
    local_root, remote_root = config["local_root"], config["remote_root"]
    cwd = os.environ.get("PWD") or os.getcwd()
    if os.path.realpath(cwd) != os.path.realpath(os.getcwd()):
        cwd = os.getcwd()
    wd = remote_dir(cwd, local_root, remote_root)
    if local_root != remote_root:
        command = command.replace(local_root, remote_root)  # absolute paths the CLI gave
    if (m := SOURCE_PREFIX.match(command)) is not None and not m["file"].startswith(remote_root.rstrip("/") + "/"):
        command = command[m.end():]  # a file of this side's shell, not the target's
    cwd_file = None
    if (m := CWD_SUFFIX.search(command)) is not None:
        cwd_file, command = m["file"], command[:m.start()]
    token = f"{config['id']}.{os.getpid()}-{os.urandom(6).hex()}"  # none is a prefix of another
    runs = Path(config["runs"])
    running = runs / "run" / token
    with contextlib.suppress(OSError):
        running.touch()
    argv = target_argv(config, command, extra, wd, token)
    log(config, args=args, cwd=cwd, there=argv)
    child: subprocess.Popen[bytes] | None = None
    stopping: list[int] = []
    parent = os.getppid()

    def stop(sig: int, _frame: Any) -> None:
        if stopping:
            return
        stopping.append(sig)
        # its token stays in run/: the turn's end sweeps it again, in case the command was
        # still starting there (not yet carrying its token) when this sweep looked
        reap(config, token)
        if child is not None:
            with contextlib.suppress(OSError):
                child.send_signal(sig)

    def orphaned(_sig: int, frame: Any) -> None:
        # the CLI is gone (not only the thread of it that started this one) and the command is not
        if os.getppid() != parent and (child is None or child.returncode is None):
            stop(signal.SIGTERM, frame)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    signal.signal(ORPHANED, orphaned)
    if arm_orphaned() and os.getppid() != parent:  # the CLI died before the kernel was told
        log(config, orphaned=True)
        return 1
    if stopping:
        return 128 + stopping[0]
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                             env={**os.environ, **config.get("env", {})})
    if stopping:  # stopped while the client was starting: the sweep may have looked too early
        with contextlib.suppress(OSError):
            child.send_signal(stopping[0])
        reap(config, token)
    code = child.wait()
    log(config, code=code, stopped=stopping)
    if not stopping:
        if code < 0 or (code == 255 and config["kind"] == "ssh"):
            # the client died (killed; the connection lost) and the command may run on there
            stopping.append(0)  # one sweep: not again when the CLI's death is told meanwhile
            if reap(config, token):
                _move(running, None)
        else:
            _move(running, runs / "done" / token)  # what it left in the background: see short.end_turn
    if cwd_file is not None and code == 0:
        Path(cwd_file).write_text(cwd + "\n")
    return code


HOOK = """\
# shoal: bash reads this (BASH_ENV) before `-c CMD` and hands CMD to the shim, which runs it in
# {target}. A command the shim runs here is marked with ${pass_} so it is not sent again.
if [ -n "${{BASH_EXECUTION_STRING+x}}" ] && [ "${{{pass_}-}}" != "$BASH_EXECUTION_STRING" ]; then
  exec {shim} -c "$BASH_EXECUTION_STRING" "$0" "$@"
fi
unset {pass_}
"""


def write(directory: Path, config: dict[str, Any], target: str) -> dict[str, str]:
    """Write the shim and the hook into `directory`; return the environment that uses them.
    Fills in the place's `id` (default: the directory's name) and `runs` in `config`, which the
    place keeps for stopping its commands (`short.end_turn`, `short.sweep`)."""
    config.setdefault("id", directory.name)  # the place's directory is named by its id
    config["runs"] = str(directory / "runs")
    for sub in ("run", "done"):
        (directory / "runs" / sub).mkdir(parents=True, exist_ok=True)
    if os.environ.get("SHOAL_SHIM_LOG"):
        config = {**config, "log": os.environ["SHOAL_SHIM_LOG"]}
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "bash"  # the name Claude Code insists on before it uses $SHELL
    source = Path(__file__).read_text()
    shim.write_text(f"#!{sys.executable} -IS\n# shoal shim for {target}\n{source}\n"
                    f"sys.exit(main(json.loads({json.dumps(json.dumps(config))})))\n")
    shim.chmod(0o755)
    hook = directory / "bash_env.sh"
    hook.write_text(HOOK.format(target=target, pass_=PASS, shim=shlex.quote(str(shim))))
    return {"SHELL": str(shim), "BASH_ENV": str(hook)}


def local_bash() -> str:
    """The real bash here (what the shim runs CLI housekeeping with), else sh."""
    for candidate in ("/bin/bash", "/usr/bin/bash", "/bin/sh"):
        if os.access(candidate, os.X_OK):
            return candidate
    return "/bin/sh"
