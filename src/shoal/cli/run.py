"""`shoal run FLOW TASK -a ROLE=backend/model ...`: run a flow file to its end."""

from __future__ import annotations

import argparse
import contextlib
import sys

from shoal.cli.watch import add_flag, alongside


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="run a flow: FLOW is file.py[:name], a package dir, or module:name")
    p.add_argument("flow")
    p.add_argument("task", nargs="?", default="", help="the task, passed as the flow's first argument")
    p.add_argument("-a", "--agent", action="append", default=[], metavar="ROLE=BACKEND/MODEL",
                   help="an agent passed to the flow as keyword ROLE (e.g. coder=opencode/loopback)")
    add_flag(p)
    p.set_defaults(func=main)


def parse_agent(spec: str) -> tuple[str, str, str]:
    role, eq, rest = spec.partition("=")
    backend, _, model = rest.partition("/")
    if not eq or not role.isidentifier() or not backend:
        raise SystemExit(f"shoal run: bad --agent {spec!r}; expected ROLE=BACKEND/MODEL, e.g. coder=opencode/loopback")
    return role, backend, model or "loopback"


def main(args: argparse.Namespace) -> int:
    import shoal
    from shoal.journal import find

    flow = shoal.load(args.flow)
    agents = {}
    try:
        for spec in args.agent:
            role, backend, model = parse_agent(spec)
            agents[role] = shoal.Agent(backend, model=model, name=role)
        if args.watch:
            result = alongside(lambda: shoal.run(flow, args.task, **agents))
        else:
            result = shoal.run(flow, args.task, **agents)
    finally:
        for agent in agents.values():
            agent.close()
        with contextlib.suppress(FileNotFoundError):
            print(f"journal: {find()}", file=sys.stderr)
    if result is not None:
        print(result)
    return 0
