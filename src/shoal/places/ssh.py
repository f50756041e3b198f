"""An ssh target: the agent stays here; its commands and its file edits land in the remote directory.

    s = agent.session(where=shoal.SSH("user@host:/srv/project", port=22, key="~/.ssh/id_ed25519"))

On the first turn the place opens one ssh connection (a ControlMaster, held by shoal) and
mounts the remote directory here with sshfs over that same connection. The CLI runs here
with its working directory on that mount, so every file it writes or edits with its own
tools is written there, at once — nothing of the work is ever only here. Its shell commands
go through the shim (`shim.py`): `ssh` over the held connection, `cd` into the remote
directory, run there; absolute paths of the mount in a command are rewritten to the remote
directory's.

Measured on a 2-core box (sshd on 127.0.0.1): connecting, probing and mounting 0.4 s, giving
back 0.03 s; a command costs ~0.19 s over the held connection (a fresh ssh login: 0.34 s), most
of it the remote login shell's own start-up (here root's ~/.bashrc runs `pyenv init`).

Given back, it unmounts, closes the connection and removes its private directory — which is
only ever deleted once it is no longer a mount point. If shoal is killed instead, ssh and
sshfs get SIGTERM from the kernel (`Proc.spawn(dies_with=SIGTERM)`): sshfs unmounts, ssh
closes the connection, and neither they nor the mount outlive it.
Anything found there after unmounting was written here while the mount was gone: it is kept,
and `close()` says where.

A killed ssh client stops nothing on the remote. The commands of a cancelled or timed-out turn
are stopped there by the shim over the held connection, and by `after_turn` for a shim that
was killed outright (shim.py, `short.end_turn`). If shoal is killed outright mid-turn, the CLI
dies with it and each of its shims, told so by the kernel, stops its command there through a
connection of its own (the held one goes with shoal).

What commands left running in the background (a server for the next turn) is stopped by the
place's lifeline: one remote process, started over the held connection when the place opens
(`shim.lifeline_script`), that waits for its stdin to end and then stops every process there
tagged with the place's id. Its stdin is a pipe shoal holds and never writes to, so it ends
when `close()` closes it, when shoal dies however it dies (the kernel closes the pipe; ssh and
the connection go too), and when the connection drops; the sweep runs there, needing nothing
here. (A connection lost while shoal lives stops them too: the place is broken then anyway.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

from shoal.errors import BadArgument, BadSetting, HostUnreachable, KeyRefused, PlaceError, number, strings
from shoal.places import registry, shim
from shoal.places.short import SWEEP_TIMEOUT, end_turn, run_short, sweep
from shoal.procs import Proc

TARGET = re.compile(r"^(?:(?P<user>[^@/:]+)@)?(?P<host>\[[^\]]+\]|[^:/]+)(?::(?P<path>.*))?$")
UNREACHABLE = re.compile(r"Connection refused|timed out|No route to host|Could not resolve|Network is unreachable"
                         r"|Connection closed|Connection reset|Name or service not known", re.I)
REFUSED = re.compile(r"Permission denied|Too many authentication failures|no mutual signature", re.I)
HOST_KEY = re.compile(r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED", re.I)
MOUNT_TIMEOUT = 20.0
# no kernel or sshfs caching: a file a remote command just made must be visible here at once
SSHFS_OPTIONS = "dir_cache=no,entry_timeout=0,attr_timeout=0,negative_timeout=0"


class SSH:
    kind = "ssh"

    def __init__(self, target: str, *, port: int | None = None, key: str | Path | None = None,
                 known_hosts: str | Path | None = None, options: list[str] | tuple[str, ...] = (),
                 connect_timeout: float = 10.0) -> None:
        """`target`: "user@host:/path" (a relative path is from the remote home). `key`: the private
        key to use (default: ssh's own choice). `known_hosts`: a known_hosts file (default: the
        user's; new hosts are accepted on first use). `options`: more ssh options ("-o", "K=V", ...)."""
        if not isinstance(target, str):
            raise BadArgument(f"ssh target must be a string 'user@host:/path', got {target!r}")
        if port is not None:
            number("ssh port", port, integer=True)
            if port > 65535:
                raise BadSetting(f"ssh port must be 1-65535, got {port}")
        strings("SSH's options", options, example="['-o', 'Compression=yes']")
        number("SSH's connect_timeout (seconds)", connect_timeout, optional=False)
        m = TARGET.match(target)
        if m is None or not m["host"] or "@" in m["host"]:
            raise PlaceError(f"ssh target {target!r} is not of the form user@host:/path")
        self.target = target
        self.dest = f"{m['user']}@{m['host']}" if m["user"] else m["host"]
        self.remote_path = m["path"] or "."
        self.port = port
        self.key = Path(key).expanduser().absolute() if key else None
        self.known_hosts = Path(known_hosts).expanduser().absolute() if known_hosts else None
        self.options = list(options)
        self.connect_timeout = connect_timeout
        self.id = registry.new_id("ssh")
        self.dir = registry.place_dir(self.id)
        self.mount = self.dir / "mnt"
        # unix sockets have a ~100-byte path limit; the place dir may be deep
        self.ctl = Path(tempfile.gettempdir()) / f"shoal-{self.id}.ctl"
        self.remote_dir: str | None = None
        self._master: Proc | None = None
        self._sshfs: Proc | None = None
        self._lifeline: Proc | None = None  # see the module docstring
        self._env: dict[str, str] = {}
        self._shim: dict[str, Any] = {}
        self._ran = False  # a command has run there: close() stops what is left of them
        self._last_err = ""
        self.opened = False

    def ssh_options(self) -> list[str]:
        opts = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(self.connect_timeout))}",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
        if self.port:
            opts += ["-o", f"Port={self.port}"]
        if self.key:
            opts += ["-o", f"IdentityFile={self.key}", "-o", "IdentitiesOnly=yes"]
        if self.known_hosts:
            opts += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        opts += ["-o", "StrictHostKeyChecking=accept-new", *self.options]
        return opts

    def check(self) -> None:
        for tool, package in (("ssh", "openssh-client"), ("sshfs", "sshfs"), ("fusermount3", "fuse3")):
            if shutil.which(tool) is None:
                raise PlaceError(f"an ssh place needs `{tool}` here (apt-get install {package})")
        if self.key is not None and not self.key.is_file():
            raise KeyRefused(f"ssh key {self.key} does not exist")

    async def open(self) -> Path:
        if self.opened:
            return self.mount
        self.check()
        try:
            await self._connect()
            self.remote_dir, shell = await self._probe()
            await self._start_lifeline()
            await self._mount()
            await self._lifeline_up()  # started before the mount, up by now: no added wait
            config = {"kind": "ssh", "id": self.id, "shell": shell, "bash": shim.local_bash(),
                      "prefix": ["ssh", *self.ssh_options(), "-o", f"ControlPath={self.ctl}", "-o", "ControlMaster=no",
                                 "-n", "-T", self.dest],
                      # a connection of its own, for stopping commands once the held one is gone
                      "direct": ["ssh", *self.ssh_options(), "-o", "ControlPath=none", "-n", "-T", self.dest],
                      "local_root": str(self.mount), "remote_root": self.remote_dir}
            self._env = shim.write(self.dir, config, f"{self.dest}:{self.remote_dir}")
            self._shim = config
            registry.add(self.id, self.kind, self.mount, target=f"{self.dest}:{self.remote_dir}", dir=str(self.dir),
                         ctl=str(self.ctl))
        except BaseException:
            await self._teardown()  # nothing half-made is left behind
            registry.remove(self.id)
            raise
        self.opened = True
        return self.mount

    async def _connect(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = ["ssh", *self.ssh_options(), "-M", "-N", "-o", "ControlPersist=no", "-o", f"ControlPath={self.ctl}",
                self.dest]
        self._master = await Proc.spawn(argv, cwd=self.dir, env=dict(os.environ), dies_with=signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + self.connect_timeout + 10
        while asyncio.get_running_loop().time() < deadline:
            if self._master.returncode is not None or self._master_exited():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._master.wait(), 5)  # and its stderr, which says why
                break
            if self.ctl.exists() and await self._run(["-O", "check"], timeout=5) is not None:
                return
            await asyncio.sleep(0.05)
        await self._master.stop()
        raise self._classify(self._master.stderr_tail())

    def _master_exited(self) -> bool:
        assert self._master is not None
        try:
            os.kill(self._master.pid, 0)
            with open(f"/proc/{self._master.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except (OSError, IndexError):
            return True

    def _classify(self, stderr: str) -> PlaceError:
        where = f"{self.dest}" + (f" port {self.port}" if self.port else "")
        if HOST_KEY.search(stderr):
            return KeyRefused(f"{where}: the host key does not match the known one ({stderr.strip()})")
        if REFUSED.search(stderr):
            return KeyRefused(f"{where} refused the key{f' {self.key}' if self.key else ''}: {stderr.strip()}")
        if UNREACHABLE.search(stderr) or not stderr.strip():
            return HostUnreachable(f"cannot reach {where} within {self.connect_timeout:.0f} s: "
                                   f"{stderr.strip() or 'no answer'}")
        return PlaceError(f"ssh to {where} failed: {stderr.strip()}")

    async def _run(self, args: list[str], remote: str | None = None, timeout: float = 30) -> str | None:
        """One ssh call over the held connection; its stdout, or None if it failed."""
        argv = ["ssh", *self.ssh_options(), "-o", f"ControlPath={self.ctl}", "-o", "ControlMaster=no", *args,
                self.dest, *([remote] if remote is not None else [])]
        code, out, err = await run_short(argv, timeout=timeout)
        self._last_err = err.strip()
        return out if code == 0 else None

    async def _probe(self) -> tuple[str, str]:
        """The remote directory (absolute, resolved) and the shell commands run in there."""
        quoted = "'" + self.remote_path.replace("'", "'\\''") + "'"
        out = await self._run([], f"cd -- {quoted} && pwd -P && (command -v bash || command -v sh)")
        lines = (out or "").split("\n")
        if out is None or len(lines) < 2 or not lines[0].startswith("/"):
            raise PlaceError(f"remote directory {self.remote_path!r} on {self.dest} cannot be used: "
                             f"{self._last_err or 'it does not exist'}")
        return lines[0].strip(), (lines[1].strip() or "sh")

    async def _start_lifeline(self) -> None:
        """Start the place's lifeline (see the module docstring) over the held connection."""
        script = shim.lifeline_script(self.id)
        argv = ["ssh", *self.ssh_options(), "-o", f"ControlPath={self.ctl}", "-o", "ControlMaster=no", "-T",
                self.dest, f"sh -c {shlex.quote(script)}"]
        # a Proc dies with shoal (PR_SET_PDEATHSIG), and the kernel closes its stdin pipe
        self._lifeline = await Proc.spawn(argv, cwd=self.dir, env=dict(os.environ), stdin=True)

    async def _lifeline_up(self) -> None:
        """Wait until the lifeline runs there: from then on nothing the place starts outlives shoal."""
        assert self._lifeline is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.connect_timeout + 10):
                while line := await self._lifeline.readline():
                    if line.rstrip().endswith(shim.LIFELINE_UP.encode()):
                        return
        lifeline, self._lifeline = self._lifeline, None
        await lifeline.stop()
        raise PlaceError(f"could not start a process on {self.dest} over the held connection: "
                         f"{lifeline.stderr_tail() or 'it did not answer'}")

    async def _end_lifeline(self) -> bool:
        """Close the lifeline's stdin: there, it stops every command of the place and ends. True
        when it said so."""
        lifeline, self._lifeline = self._lifeline, None
        if lifeline is None:
            return False
        try:
            with contextlib.suppress(OSError, RuntimeError):
                await lifeline.write(b"", close=True)
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(lifeline.wait(), SWEEP_TIMEOUT) == 0
            return False
        finally:
            if lifeline.returncode is None:
                await lifeline.stop()

    async def _mount(self) -> None:
        self.mount.mkdir(parents=True, exist_ok=True)
        opts = [f"-o{o}" for o in (SSHFS_OPTIONS, f"ControlPath={self.ctl}", "ControlMaster=no")]
        opts += [f"-o{self.ssh_options()[i + 1]}" for i in range(0, len(self.ssh_options()) - 1, 2)
                 if self.ssh_options()[i] == "-o"]
        argv = ["sshfs", "-f", f"{self.dest}:{self.remote_dir}", str(self.mount), *opts]
        self._sshfs = await Proc.spawn(argv, cwd=self.dir, env=dict(os.environ), dies_with=signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + MOUNT_TIMEOUT
        while asyncio.get_running_loop().time() < deadline:
            if os.path.ismount(self.mount):
                return
            if self._sshfs.returncode is not None:
                break
            await asyncio.sleep(0.05)
        tail = self._sshfs.stderr_tail()
        raise PlaceError(f"could not mount {self.dest}:{self.remote_dir} at {self.mount} with sshfs: "
                         f"{tail or 'timed out'} (is FUSE available here? /dev/fuse)")

    def env(self) -> dict[str, str]:
        return dict(self._env)

    async def after_turn(self) -> None:
        if self.opened and self._shim and await end_turn(self._shim):  # see short.end_turn
            self._ran = True
        if self.opened and not os.path.ismount(self.mount):
            raise PlaceError(f"the sshfs mount of {self.dest}:{self.remote_dir} at {self.mount} went away; "
                             f"anything written there since is only here")

    async def _teardown(self) -> str | None:
        """Unmount, disconnect, and remove the private directory only once it is not a mount."""
        if os.path.ismount(self.mount):
            for args in (["-u"], ["-u", "-z"]):  # lazily if a process still has it open
                proc = await asyncio.create_subprocess_exec("fusermount3", *args, str(self.mount),
                                                            stdout=asyncio.subprocess.DEVNULL,
                                                            stderr=asyncio.subprocess.DEVNULL)
                if await proc.wait() == 0:
                    break
        await self._end_lifeline()  # when opening failed: nothing ran there to stop
        if self._sshfs is not None:
            await self._sshfs.stop()
            self._sshfs = None
        if self._master is not None:
            with contextlib.suppress(Exception):
                await self._run(["-O", "exit"], timeout=5)
            await self._master.stop()
            self._master = None
        with contextlib.suppress(OSError):
            self.ctl.unlink()
        if os.path.ismount(self.mount) or mounted_under(self.dir):
            return f"kept {self.dir}: {self.mount} could not be unmounted (run `fusermount3 -u {self.mount}`)"
        if self.mount.exists() and any(self.mount.iterdir()):
            return f"kept {self.mount}: files were written there while the remote was not mounted"
        await asyncio.to_thread(shutil.rmtree, self.dir, True)
        return None

    async def close(self) -> str | None:
        if not self.opened:
            return None
        self.opened = False
        # what commands left in the background there (nothing stops it when ssh goes): the
        # lifeline stops it; a sweep of its own if the lifeline could not
        if not await self._end_lifeline() and self._ran and self._master is not None:
            await sweep(self._shim)
        note = await self._teardown()
        if note is None:
            registry.remove(self.id)
        else:
            registry.update(self.id, status="kept", holds=note)
        return note

    def describe(self) -> str:
        return f"ssh {self.dest}:{self.remote_dir or self.remote_path}"


async def clean(entry: registry.Entry) -> tuple[bool, str]:
    """`shoal places clean`: unmount and remove what a gone owner left. (removed?, why)"""
    d, mount = Path(entry["dir"]), Path(entry["path"])
    if os.path.ismount(mount) or _stale_mount(mount):
        proc = await asyncio.create_subprocess_exec("fusermount3", "-u", "-z", str(mount),
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        await proc.wait()
    if os.path.ismount(mount) or mounted_under(d):
        return False, f"still mounted; unmount it with `fusermount3 -u {mount}`"
    if mount.is_dir() and any(mount.iterdir()):
        return False, "holds files written while the remote was not mounted; copy them to the remote first"
    shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(OSError):
        Path(str(entry.get("ctl", ""))).unlink()
    return True, "unmounted and removed (the work is on the remote)"


def mounted_under(directory: Path) -> bool:
    """Is anything mounted at or below `directory`? (Checked before deleting it: a live mount
    there would make a recursive delete reach into the remote.)"""
    prefix = str(directory.absolute())
    try:
        with open("/proc/self/mounts") as f:
            points = [line.split()[1].replace("\\040", " ") for line in f]
    except OSError:
        return True  # cannot tell: do not delete
    return any(p == prefix or p.startswith(prefix + "/") for p in points)


def _stale_mount(path: Path) -> bool:
    """A FUSE mount whose process died: stat fails with ENOTCONN ("Transport endpoint...")."""
    try:
        path.stat()
    except OSError as exc:
        return exc.errno == 107
    return False


async def holds(entry: registry.Entry) -> str:
    return f"mount of {entry.get('target')}"
