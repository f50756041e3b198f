"""`shoal opencode serve`: one secured opencode server for people to attach to, here or from afar.

It binds 127.0.0.1 unless told otherwise, always with a password (generated unless
OPENCODE_SERVER_PASSWORD is set), and prints the `opencode attach` command with it and the
`ssh -N -L` line that carries the port to a second device. A non-loopback bind is refused
unless the password is the user's own, and then comes with a warning: basic auth needs TLS.
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.agent import Agent


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("opencode", help="opencode helpers (serve: a secured server to attach to)")
    cmds = p.add_subparsers(dest="opencode_command", required=True)
    s = cmds.add_parser("serve", help="start a secured `opencode serve` and print how to attach to it")
    s.add_argument("--model", default="loopback", help="provider/model, or 'loopback' (default)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need "
                   "OPENCODE_SERVER_PASSWORD set by you, and TLS in front)")
    s.add_argument("--port", type=int, default=4096, help="port (default 4096, opencode's own)")
    s.add_argument("--dir", type=Path, default=None, help="the project directory (default: here)")
    s.add_argument("--home", type=Path, default=None,
                   help="where its config and sessions live (default: shoal's state dir, kept between runs)")
    s.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import shoal
    from shoal.backends.opencode_server import check_bind
    from shoal.errors import ShoalError
    from shoal.homes import state_dir
    from shoal.runtime import runtime

    explicit = os.environ.get("OPENCODE_SERVER_PASSWORD")
    try:
        warning = check_bind(args.host, bool(explicit))
    except ValueError as exc:
        raise ShoalError(str(exc)) from None
    if warning:
        print(f"shoal: warning: {warning}", file=sys.stderr)
    directory = (args.dir or Path.cwd()).resolve()
    if not directory.is_dir():
        raise ShoalError(f"--dir {directory} is not a directory; pass the project directory to serve")
    if not 1 <= args.port <= 65535:
        raise ShoalError(f"--port must be 1-65535, got {args.port}")
    busy = _port_taken(args.host, args.port)
    if busy:
        raise ShoalError(f"cannot listen on {args.host}:{args.port}: {busy}; pick another --port")
    home = args.home or state_dir() / "opencode-serve"
    with shoal.Agent("opencode", model=args.model, home=home, transport="server") as agent:
        runtime.call(_serve(agent, directory, args.host, args.port, explicit or secrets.token_urlsafe(18)))
    return 0


async def _serve(agent: Agent, directory: Path, host: str, port: int, password: str) -> None:
    from shoal.backends.opencode import OpenCode
    from shoal.backends.opencode_server import Server

    backend = agent.backend
    assert isinstance(backend, OpenCode)
    backend.settings.home.mkdir(parents=True, exist_ok=True)
    server = await Server.start(backend.cli, env=backend.env, cwd=directory, generation=1, host=host, port=port,
                                password=password)
    try:
        _tell(server.url, host, password, directory, backend.cli)
        code = await server.proc.wait()
        print(f"shoal: the opencode server exited (code {code})\n{server.proc.stderr_tail()}", file=sys.stderr)
    finally:
        await server.close()


def _port_taken(host: str, port: int) -> str:
    """Why `host:port` cannot be listened on ("" if it can): said before opencode starts, which
    would only say "ServeError"."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r} ({exc})"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no obstacle
        try:
            probe.bind(addr)
        except OSError as exc:
            return exc.strerror or str(exc)
    return ""


def _tell(url: str, host: str, password: str, directory: Path, cli: str) -> None:
    port = url.rsplit(":", 1)[-1].strip("/")
    target = "127.0.0.1" if host in ("0.0.0.0", "::", "localhost") else host  # where ssh forwards to
    print(f"opencode server for {directory} on {url} (user opencode, password {password})", flush=True)
    print(f"  attach here:      {cli} attach {url} --password {password} --dir {directory}")
    print("  from a second device, one command per terminal (the listener stays on this machine's loopback):")
    print(f"    ssh -N -L {port}:{target}:{port} {getpass.getuser()}@{socket.getfqdn()}")
    print(f"    opencode attach http://127.0.0.1:{port} --password {password}")
    print("  Ctrl-C stops it.", flush=True)

