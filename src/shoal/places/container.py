"""A container apiece: brought up on the session's first turn, taken down with the agent.

The project directory itself is mounted at the same path (not copied), and everything runs
as the calling user's uid:gid, so what a command writes there is the user's and outlives the
container. The agent CLI keeps running here with its own credentials; only its shell
commands land in the container, through the shim in `shim.py` (`env()` hands it to the CLI).

The container's main process is `sh` waiting on its stdin, which is a pipe held by the
attached `<engine> run -i --rm` client shoal started. However shoal ends — closed, killed,
crashed — that pipe closes, the main process exits and `--rm` removes the container, so no
container outlives the process that made it; `close()` removes it at once besides.

A command of a cancelled or timed-out turn is stopped in the container there and then, not
when the container goes: killing `<engine> exec` stops nothing inside, so the shim does it,
and `after_turn` sweeps what a killed shim could not (shim.py, `short.end_turn`).

Measured with podman/runc on a 2-core box: up 0.3 s (8 at once: 1.5 s), down 0.15 s, and each
command ~0.19 s (`podman exec`) where a local one takes 1 ms.

podman and docker have the same CLI surface for all of this, and both are tested for real
(docker: dockerd 20.10 with a 28 client; up 0.4 s, down 0.1 s). On hosts where podman needs
settings (runtime, cgroup manager, ulimits), give them the usual way (`CONTAINERS_CONF`,
containers.conf); that environment is captured when the place is made and given to every
`exec` the shim runs, since the CLI's own environment is a clean one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from shoal.errors import BadArgument, EngineNotFound, ImageNotFound, PlaceError, strings
from shoal.places import registry, shim
from shoal.places.base import Place
from shoal.places.short import end_turn, run_short
from shoal.procs import Proc

READY = "shoal-container-ready"
START_TIMEOUT = 120.0  # a first run may set up storage; an image that is present starts in < 1 s
PROBE_TIMEOUT = 30.0
# the engine's own environment, captured for the shim (the CLI hands its commands a clean one)
ENGINE_ENV = ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF", "CONTAINER_HOST", "CONTAINER_CONNECTION",
              "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "XDG_RUNTIME_DIR", "PATH")


async def _engine(argv: list[str], timeout: float = PROBE_TIMEOUT) -> tuple[int, str]:
    """Run an engine command to completion: (exit code, stdout and stderr)."""
    code, out, err = await run_short(argv, timeout=timeout)
    return code, "\n".join(t for t in (out.strip(), err.strip()) if t)


def linked_git_dir(project: Path) -> Path | None:
    """The repository's .git for a linked worktree (its `.git` is a file naming a dir inside it)."""
    dot_git = project / ".git"
    if not dot_git.is_file():
        return None
    text = dot_git.read_text().strip()
    if not text.startswith("gitdir:"):
        return None
    gitdir = (project / text.removeprefix("gitdir:").strip()).resolve()
    common = gitdir / "commondir"
    root = (gitdir / common.read_text().strip()).resolve() if common.is_file() else gitdir
    return None if project.resolve().is_relative_to(root) else root


def _rm(engine: str, name: str) -> list[str]:
    # podman waits 10 s for a stop by default; docker's `rm --force` kills at once and has no --time
    return [engine, "rm", "--force", *(["--time", "0"] if "podman" in Path(engine).name else []), name]


class Container:
    kind = "container"

    def __init__(self, image: str, *, path: str | Path | Place | None = None, engine: str = "podman",
                 network: str | None = None, options: list[str] | tuple[str, ...] = ()) -> None:
        """`path`: the project directory to mount (default: the current one), or a Place whose
        directory is used (e.g. `Worktree(...)`: a worktree apiece inside a container apiece).
        `network`: the engine's --network value (default: the engine's default).
        `options`: more `run` options, e.g. ["--memory", "2g", "-v", "/data:/data:ro"]."""
        if not isinstance(image, str) or not image.strip():
            raise BadArgument(f"Container needs an image name, e.g. shoal.Container('debian:12'); got {image!r}")
        if not isinstance(engine, str) or not engine:
            raise BadArgument(f"Container's engine must be a command name such as 'podman' or 'docker', got {engine!r}")
        if network is not None and not isinstance(network, str):
            raise BadArgument(f"Container's network must be the engine's --network value (a str), got {network!r}")
        if path is not None and not isinstance(path, (str, Path)) and not callable(getattr(path, "check", None)):
            raise BadArgument(f"Container's path must be a directory or a place such as shoal.Worktree(...), "
                              f"got {path!r}")
        strings("Container's options", options, example="['--memory', '2g']")
        self.image = image
        self.engine = engine
        self.inner: Place | None = path if path is not None and not isinstance(path, (str, Path)) else None
        self.project = Path(path if isinstance(path, (str, Path)) else ".").expanduser().absolute()
        self.network = network
        self.options = list(options)
        self.id = registry.new_id("container")
        self.name = f"shoal-{self.id.removeprefix('container-')}"
        self.engine_path: str | None = None
        self._proc: Proc | None = None
        self._env: dict[str, str] = {}
        self._shim: dict[str, Any] = {}
        self.opened = False

    def check(self) -> None:
        self.engine_path = shutil.which(self.engine)
        if self.engine_path is None:
            raise EngineNotFound(f"container engine {self.engine!r} is not installed (not on PATH); "
                                 f"install it (e.g. `apt-get install podman`) or pass engine='podman'/'docker'")
        if self.inner is not None:
            self.inner.check()
        elif not self.project.is_dir():
            raise PlaceError(f"cannot mount {self.project} into a container: it is not a directory")

    async def open(self) -> Path:
        if self.opened:
            return self.project
        self.check()
        if self.inner is not None:
            self.project = await self.inner.open()
        try:
            await self._check_image()
            await self._start()
            shell = await self._shell()
            engine_env = {k: os.environ[k] for k in ENGINE_ENV if k in os.environ}
            config = {"kind": "container", "name": self.name, "shell": shell, "bash": shim.local_bash(),
                      "prefix": [str(self.engine_path), "exec", "--user", f"{os.getuid()}:{os.getgid()}"],
                      "local_root": str(self.project), "remote_root": str(self.project), "env": engine_env}
            self._env = shim.write(registry.place_dir(self.id), config, f"container {self.name}")
            self._shim = config
            registry.add(self.id, self.kind, self.project, engine=self.engine, container=self.name,
                         image=self.image, shim=str(registry.place_dir(self.id)))
        except BaseException:
            await self._remove()  # nothing half-made is left behind
            await asyncio.to_thread(shutil.rmtree, registry.place_dir(self.id), True)
            if self.inner is not None:
                await self.inner.close()
            raise
        self.opened = True
        return self.project

    async def _check_image(self) -> None:
        assert self.engine_path is not None
        try:
            code, out = await _engine([self.engine_path, "image", "inspect", "--format", "{{.Id}}", self.image])
        except TimeoutError:
            raise EngineNotFound(f"{self.engine} did not answer within {PROBE_TIMEOUT:.0f} s; is it working?") from None
        if code == 0:
            return
        low = out.lower()
        # docker 28 says "Error response from daemon: No such image" (the engine did answer)
        gone = "no such image" in low or "image not known" in low
        if not gone and ("daemon" in low or "connect" in low):
            raise EngineNotFound(f"{self.engine} is installed but cannot reach its engine: {out}")
        said = out.splitlines()[-1] if out else f"exit {code}"
        raise ImageNotFound(f"image {self.image!r} is not in {self.engine}'s local store ({said}). "
                            f"Pull it (`{self.engine} pull {self.image}`) or build/import it first.")

    async def _start(self) -> None:
        assert self.engine_path is not None
        uid, gid = os.getuid(), os.getgid()
        argv = [self.engine_path, "run", "-i", "--rm", "--name", self.name, "--label", f"shoal.place={self.id}",
                "--label", f"shoal.pid={os.getpid()}", "--user", f"{uid}:{gid}",
                "--volume", f"{self.project}:{self.project}", "--workdir", str(self.project)]
        if uid != 0 and "podman" in Path(str(self.engine_path)).name:
            argv.append("--userns=keep-id")  # rootless podman: the caller's uid inside is the caller's outside
        git_dir = linked_git_dir(self.project)
        if git_dir is not None:  # a worktree's history lives in its repository's .git: git works inside too
            argv += ["--volume", f"{git_dir}:{git_dir}"]
        if self.network:
            argv += ["--network", self.network]
        # the main process only waits for shoal's end: EOF on stdin (see the module docstring)
        argv += [*self.options, "--entrypoint", "sh", self.image, "-c", f"echo {READY}; while read -r _; do :; done"]
        self._proc = await Proc.spawn(argv, cwd=self.project, env=dict(os.environ), stdin=True)
        try:
            async with asyncio.timeout(START_TIMEOUT):
                while line := await self._proc.readline():
                    if line.decode(errors="replace").strip() == READY:
                        return
        except TimeoutError:
            raise PlaceError(f"container {self.name} did not start within {START_TIMEOUT:.0f} s") from None
        await self._proc.wait()
        raise PlaceError(f"container {self.name} from {self.image!r} did not start:\n{self._proc.stderr_tail()}")

    async def _shell(self) -> str:
        """bash if the image has it (what the CLIs expect), else its sh."""
        assert self.engine_path is not None
        code, out, _ = await run_short([self.engine_path, "exec", self.name, "sh", "-c",
                                        "command -v bash || command -v sh || echo sh"], timeout=PROBE_TIMEOUT)
        lines = out.strip().splitlines()
        return lines[-1].strip() if code == 0 and lines else "sh"

    def env(self) -> dict[str, str]:
        return dict(self._env)

    async def after_turn(self) -> None:
        # what the turn's commands left running in the container (see short.end_turn); the
        # rest goes with the container at close
        if self.opened and self._shim:
            await end_turn(self._shim)

    async def _remove(self) -> None:
        if self.engine_path is not None and self._proc is not None:
            with contextlib.suppress(Exception):
                await _engine(_rm(self.engine_path, self.name))
        if self._proc is not None:
            await self._proc.stop(grace=5.0)
            self._proc = None

    async def close(self) -> str | None:
        if not self.opened:
            return None
        self.opened = False
        await self._remove()
        await asyncio.to_thread(shutil.rmtree, registry.place_dir(self.id), True)
        registry.remove(self.id)
        # nothing of the work is in the container: it was written to the mounted directory
        return await self.inner.close() if self.inner is not None else None

    def describe(self) -> str:
        return f"container {self.name} ({self.image}, {self.engine}) at {self.project}"


async def clean(entry: registry.Entry) -> tuple[bool, str]:
    """`shoal places clean`: remove a container whose owner is gone. (removed?, why)"""
    engine = shutil.which(str(entry.get("engine", "podman")))
    if engine is not None:
        code, out = await _engine(_rm(engine, str(entry.get("container"))))
        if code != 0 and "no such container" not in out.lower() and "no container" not in out.lower():
            return False, f"could not remove container: {out}"
    if entry.get("shim"):
        shutil.rmtree(str(entry["shim"]), ignore_errors=True)
    return True, "container removed (its owner is gone; the work was in the mounted directory)"


async def holds(entry: registry.Entry) -> str:
    return f"container {entry.get('container')} of {entry.get('image')} mounting {entry.get('path')}"
