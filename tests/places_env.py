"""Fixtures for the places tests: a private registry, a tiny container image, container
engines (podman; a private dockerd), a real sshd.

Imported by the tests/test_places_*.py modules (`from places_env import ...`). Everything is
built here from what `scripts/setup.sh` installs (podman, runc, docker.io, busybox-static,
openssh-server, sshfs), cached under ~/.cache/shoal/test-places so a run does not rebuild it.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CACHE = Path.home() / ".cache" / "shoal" / "test-places"
IMAGE = "localhost/shoal-test:busybox-1"
MARKER = "only-in-the-shoal-test-image"
# What this machine needs for podman to start a container (see the machine facts):
# runc, cgroupfs, and no default ulimits (raising RLIMIT_NOFILE is not permitted here).
CONTAINERS_CONF = '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n'


def need(tool: str) -> str:
    """The tool's path; a missing one fails under CI (setup.sh installs it) and skips elsewhere."""
    path = shutil.which(tool) or (f"/usr/sbin/{tool}" if os.access(f"/usr/sbin/{tool}", os.X_OK) else None)
    if path is None:
        message = f"{tool} is not installed (bash scripts/setup.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(autouse=True)
def shoal_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own registry and state directory, so tests never see each other's places."""
    home = tmp_path / "shoal-home"
    monkeypatch.setenv("SHOAL_HOME", str(home))
    return home


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with one commit."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    git(r, "config", "user.email", "t@example.com")
    git(r, "config", "user.name", "t")
    (r / "README").write_text("hello\n")
    git(r, "add", "README")
    git(r, "commit", "-qm", "one")
    return r


def _rootfs_tar() -> Path:
    """A root filesystem of one static busybox (~2 MB) and the marker file, built once."""
    tar = CACHE / "busybox-rootfs-1.tar"
    if tar.exists():
        return tar
    busybox = need("busybox")
    ldd = subprocess.run(["ldd", busybox], capture_output=True, text=True)
    if "not a dynamic executable" not in ldd.stdout + ldd.stderr:
        pytest.fail(f"{busybox} is not static; the image needs busybox-static (apt-get install busybox-static)")
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / "rootfs"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("bin", "etc", "tmp", "root"):
        (root / d).mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if not (root / "bin" / applet).exists():
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "shoal-marker").write_text(MARKER + "\n")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "tmp").chmod(0o1777)
    partial = tar.with_suffix(".partial")
    with tarfile.open(partial, "w") as t:
        t.add(root, arcname=".")
    partial.replace(tar)
    shutil.rmtree(root, ignore_errors=True)
    return tar


@pytest.fixture(scope="session")
def podman_image() -> Iterator[str]:
    """The test image in podman's store; podman set up to start containers on this machine."""
    podman = need("podman")
    if subprocess.run([podman, "image", "exists", IMAGE]).returncode != 0:
        subprocess.run([podman, "import", str(_rootfs_tar()), IMAGE], check=True, capture_output=True)
    saved = os.environ.get("CONTAINERS_CONF")
    probe = [podman, "run", "--rm", "--network", "none", IMAGE, "true"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        conf = CACHE / "containers.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(CONTAINERS_CONF)
        os.environ["CONTAINERS_CONF"] = str(conf)
        done = subprocess.run(probe, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"podman cannot start a container here: {done.stderr.strip()}")
    yield IMAGE
    if saved is None:
        os.environ.pop("CONTAINERS_CONF", None)
    else:
        os.environ["CONTAINERS_CONF"] = saved


# What dockerd (20.10) makes outside its --data-root/--exec-root, whatever it is told: its
# trust key, the plugin socket directory, and containerd's shim socket directory. Removed at
# the end when the private daemon made them (and they are empty: another daemon may use them).
DOCKERD_OUTSIDE = ("/etc/docker/key.json", "/run/docker", "/run/docker/plugins", "/run/containerd",
                   "/run/containerd/s")
DOCKERD_START_TIMEOUT = 30.0


@dataclass
class Dockerd:
    """A private Docker engine: `docker` (the client, `engine`) reaches it with `DOCKER_HOST=host`."""
    engine: str
    host: str
    image: str

    def docker(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.engine, *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "DOCKER_HOST": self.host})


def _dies_with_me() -> Callable[[], None]:
    """preexec_fn: the daemon gets SIGTERM if this test process dies without stopping it."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_dockerd(proc: subprocess.Popen[bytes], root: Path) -> None:
    """Stop the daemon (it stops its containerd), then anything of its still alive (containerd,
    a shim: their command lines name `root`), then unmount what is left under `root`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    wait_until(lambda: not processes_running(str(root)), 10)
    for line in processes_running(str(root)):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f if line.split()[1].startswith(str(root) + "/")]
    for mount in reversed(mounts):
        subprocess.run(["umount", "-l", mount], capture_output=True)


@pytest.fixture(scope="session")
def dockerd() -> Iterator[Dockerd]:
    """A Docker engine of this test session's own: dockerd (Debian's docker.io, 20.10) with its
    own data root, exec root, pid file and socket in a temporary directory, no bridge or
    iptables (the containers need no network), and the test image imported into it (no
    registry needed). Stopped at the end, leaving no process and no directory behind."""
    client = need("docker")
    daemon = need("dockerd")
    if os.geteuid() != 0:
        pytest.skip("dockerd needs root (rootless docker is not set up here); run the docker tests as root")
    made = [p for p in map(Path, DOCKERD_OUTSIDE) if not p.exists()]
    root = Path(tempfile.mkdtemp(prefix="shoal-dockerd-"))
    tried: list[str] = []
    proc: subprocess.Popen[bytes] | None = None
    box: Dockerd | None = None
    try:
        for driver in ("overlay2", "vfs"):  # vfs: where overlayfs cannot be mounted (slow, but works)
            d = root / driver
            d.mkdir()
            log = d / "dockerd.log"
            box = Dockerd(client, f"unix://{d / 'docker.sock'}", IMAGE)
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [daemon, "--data-root", str(d / "data"), "--exec-root", str(d / "exec"),
                     "--pidfile", str(d / "dockerd.pid"), "-H", box.host, "--storage-driver", driver,
                     "--iptables=false", "--ip6tables=false", "--bridge=none"],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, preexec_fn=_dies_with_me())
            deadline = time.monotonic() + DOCKERD_START_TIMEOUT
            up = False
            while not up and proc.poll() is None and time.monotonic() < deadline:
                up = (d / "docker.sock").exists() and box.docker("version", timeout=10).returncode == 0
                time.sleep(0 if up else 0.1)
            if up:
                imported = box.docker("import", str(_rootfs_tar()), IMAGE)
                ran = box.docker("run", "--rm", "--network", "none", IMAGE, "cat", "/etc/shoal-marker")
                if imported.returncode == 0 and ran.stdout.strip() == MARKER:
                    break
                tried.append(f"{driver}: {(imported.stderr + ran.stderr).strip()[-500:]}")
            else:
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
                why = (f"exited ({proc.returncode})" if proc.poll() is not None
                       else f"did not answer within {DOCKERD_START_TIMEOUT:.0f} s")
                tried.append(f"{driver}: dockerd {why}: {tail}")
            _stop_dockerd(proc, d)
            proc = None
        if proc is None or box is None:
            pytest.skip("a private dockerd cannot run a container here: " + "; ".join(tried))
        yield box
    finally:
        if proc is not None and box is not None:
            with contextlib.suppress(Exception):
                ids = box.docker("ps", "-aq", timeout=30).stdout.split()
                if ids:
                    box.docker("rm", "--force", *ids, timeout=60)
            _stop_dockerd(proc, root)
        shutil.rmtree(root, ignore_errors=True)
        for path in reversed(made):  # what the daemon made outside its root: children first
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()


@dataclass
class Engine:
    """A container engine the places tests run against, as shoal.Container(engine=name) sees it."""
    name: str  # "podman" | "docker"
    image: str
    env: dict[str, str] = field(default_factory=dict)  # what the engine's client needs (DOCKER_HOST)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.name, *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **self.env})

    def containers(self, label: str = "shoal.place") -> list[str]:
        """Every container (running or not) this engine has that shoal made."""
        return self.run("ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}").stdout.split()


@pytest.fixture(params=["podman", "docker"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """Each container engine in turn. For docker: the private dockerd, with DOCKER_HOST set for
    the test, so shoal, the shim it writes and everything the test starts reach it."""
    if request.param == "podman":
        return Engine("podman", request.getfixturevalue("podman_image"))
    box: Dockerd = request.getfixturevalue("dockerd")
    monkeypatch.setenv("DOCKER_HOST", box.host)
    monkeypatch.delenv("DOCKER_CONTEXT", raising=False)
    return Engine("docker", box.image, {"DOCKER_HOST": box.host})


@dataclass
class Sshd:
    port: int
    user: str
    key: Path
    known_hosts: Path
    env_marker: str  # sshd sets SHOAL_TEST_REMOTE to this in every session: only there

    def target(self, path: Path) -> str:
        return f"{self.user}@127.0.0.1:{path}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A real OpenSSH server on 127.0.0.1 with a generated host key and user key."""
    binary = need("sshd")
    need("sshfs")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    port = _free_port()
    marker = f"sshd-{port}"
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        f"StrictModes no\nPidFile {d / 'sshd.pid'}\nSubsystem sftp internal-sftp\nSetEnv SHOAL_TEST_REMOTE={marker}\n"
        "MaxSessions 100\nMaxStartups 100\n")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    log = open(d / "sshd.log", "w")  # noqa: SIM115 - sshd writes to it for the whole session
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(d / "sshd_config")], stderr=log)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        if proc.poll() is not None:
            pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()}")
        time.sleep(0.05)
    host_pub = (d / "host.pub").read_text().split()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    try:
        yield Sshd(port, getpass.getuser(), d / "user", d / "known_hosts", marker)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def fuse_mounts() -> list[str]:
    """Mount points of every sshfs mount on the machine."""
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[2] == "fuse.sshfs"]


def processes_running(marker: str) -> list[str]:
    """Live processes on this machine (containers' and the loopback sshd's included) whose command
    line holds `marker`: "pid: command line"."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and marker in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def wait_until(check: Callable[[], object], timeout: float) -> object:
    """`check()` once it is truthy, or its last falsy value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def sleeper() -> str:
    """A command line no other process has: `sleep <a unique number of seconds>`, ~1 year."""
    return f"sleep {31_000_000 + (os.getpid() * 7919 + time.time_ns() // 1000) % 999_983}"
