"""`shoal run FLOW TASK -a ROLE=backend/model ...`: run a flow file to its end."""

from __future__ import annotations

import argparse
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


def _latest() -> str | None:
    from shoal.journal import find

    try:
        return str(find())
    except FileNotFoundError:
        return None


def main(args: argparse.Namespace) -> int:
    import shoal

    flow = shoal.load(args.flow)
    agents = {}
    before = _latest()
    try:
        for spec in args.agent:
            role, backend, model = parse_agent(spec)
            agents[role] = shoal.Agent(backend, model=model, name=role)
        try:
            flow.check(args.task, **agents)  # its arguments, before anything starts
        except shoal.FlowArguments as exc:
            hint = " ".join(f"-a {name}=BACKEND/MODEL" for name in exc.missing)
            raise shoal.FlowArguments(f"{exc}" + (f"; pass {hint}" if hint else ""), missing=exc.missing) from None
        if args.watch:
            result = alongside(lambda: shoal.run(flow, args.task, **agents))
        else:
            result = shoal.run(flow, args.task, **agents)
    finally:
        for agent in agents.values():
            agent.close()
        latest = _latest()
        if latest is not None and latest != before:
            print(f"journal: {latest}", file=sys.stderr)
    if result is not None:
        print(result)
    return 0
