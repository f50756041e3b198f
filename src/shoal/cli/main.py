"""The `shoal` command: parse, dispatch, turn errors into one clear line and an exit code."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

COMMANDS = ("batch", "bench", "demo", "loopback", "opencode", "places", "run", "trace", "watch")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shoal", description="One coding agent, many conversations at once.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"shoal.cli.{name}").add_parser(sub)
    return p


_stopped_by = {"code": 130}


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so every CLI process is stopped on the way out
    _stopped_by["code"] = 143
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    from shoal.errors import ShoalError

    try:
        return int(args.func(args) or 0)
    except ShoalError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shoal: stopped", file=sys.stderr)
        return _stopped_by["code"]


if __name__ == "__main__":
    sys.exit(main())
