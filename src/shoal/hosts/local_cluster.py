"""A Ray cluster on this one machine: for trying `shoal.Ray` out, for the tests and the bench.

    with LocalCluster([{"head": 4}, {"node2": 4}]) as cluster:
        agent = shoal.Agent("codex", hosts=shoal.Ray(address=cluster.address, resources={"node2": 1}))

Each node is a `ray start --block` process leading a process group of its own: stopping the
cluster stops exactly these processes (TERM, then KILL, by group), never every Ray process
on the machine as `ray stop` would. Node i listens on 127.0.0.(i+2): a loopback address of
its own, so the nodes are told apart by address as on a real cluster and no traffic leaves
the loopback. (Ray turns 127.0.0.1 itself into the machine's outward address, so it is not used.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from shoal.errors import HostError

START_TIMEOUT = 120.0  # a node starts in ~5 s on an idle 2-core machine; far more when it is loaded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


class LocalCluster:
    """A head node and more nodes on this machine, each with the custom resources given."""

    def __init__(self, nodes: list[dict[str, float]], *, num_cpus: int = 2, object_store_mb: int = 100,
                 env: dict[str, str] | None = None) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least its head node")
        self.nodes = nodes
        self.num_cpus = num_cpus
        self.object_store_mb = object_store_mb
        self.env = dict(env or {})
        self.ips = [f"127.0.0.{i + 2}" for i in range(len(nodes))]
        self.port = 0
        self.client_port = 0  # Ray Client's (`ray://127.0.0.2:<client_port>`)
        self.dir = Path(".")
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def address(self) -> str:
        return f"{self.ips[0]}:{self.port}"

    def log(self, i: int) -> Path:
        return self.dir / f"node{i}.log"

    def start(self) -> LocalCluster:
        ray_cli = Path(sys.executable).with_name("ray")
        if not ray_cli.exists():
            raise HostError(f"no `ray` command next to {sys.executable}: `pip install 'shoal[ray]'`")
        self.dir = Path(tempfile.mkdtemp(prefix="shoal-ray-", dir="/tmp"))  # short: Ray's socket paths must fit
        self.port, self.client_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_USAGE_STATS_ENABLED="0", **self.env)
        common = ["--num-cpus", str(self.num_cpus), "--object-store-memory", str(self.object_store_mb * 1024 * 1024),
                  "--temp-dir", str(self.dir / "t"), "--disable-usage-stats"]
        try:
            for i, (ip, resources) in enumerate(zip(self.ips, self.nodes, strict=True)):
                where = (["--head", "--port", str(self.port), "--include-dashboard=false",
                          "--ray-client-server-port", str(self.client_port)] if i == 0 else ["--address", self.address])
                argv = [str(ray_cli), "start", "--block", "--node-ip-address", ip, *where,
                        "--resources", json.dumps(resources), *common]
                with open(self.log(i), "ab") as out:
                    self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                       start_new_session=True))
                if i == 0:
                    self._wait(lambda: accepts(self.ips[0], self.port), "the head node", 0)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_nodes(self, alive: int) -> None:
        """Block until `alive` nodes have joined (needs `ray` connected to this cluster)."""
        import ray

        self._wait(lambda: len([n for n in ray.nodes() if n["Alive"]]) >= alive, f"{alive} live nodes",
                   len(self.procs) - 1)

    def node_ids(self) -> dict[str, str]:
        """Node address -> Ray node id, for the live nodes (needs `ray` connected)."""
        import ray

        return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def _wait(self, ok: object, what: str, log: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ok():  # type: ignore[operator]
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                tail = self.log(log).read_text(errors="replace")[-3000:] if self.log(log).exists() else ""
                raise HostError(f"local Ray cluster: no {what} within {START_TIMEOUT:.0f} s\n{tail}")
            time.sleep(0.5)

    def stop(self) -> None:
        """TERM each node's process group (a clean stop), then KILL it: the group may outlive its leader."""
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            for p in self.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
            deadline = time.monotonic() + wait
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.1, deadline - time.monotonic()))
        self.procs = []
        if self.dir != Path("."):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
