"""`shoal loopback`: run the loopback model in the foreground for CLIs started by hand."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("loopback", help="serve the scripted loopback model on 127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    p.add_argument("--log", type=Path, help="append every request as a JSON line to this file")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from shoal.loopback import LoopbackModel

    if not 0 <= args.port <= 65535:
        raise SystemExit(f"shoal loopback: --port must be 0-65535 (0: any free one), got {args.port}")
    if args.log is not None:
        try:  # every request is appended to it: a log that cannot be written is said now, not per request
            with open(args.log, "a"):
                pass
        except OSError as exc:
            raise SystemExit(f"shoal loopback: cannot write --log {args.log}: {exc.strerror}") from None
    model = LoopbackModel(port=args.port, log_path=args.log)
    try:
        model.start()
    except OSError as exc:
        raise SystemExit(f"shoal loopback: cannot listen on 127.0.0.1:{args.port}: {exc.strerror}; "
                         "pick another --port, or leave it out for any free one") from None
    print(f"shoal loopback model on {model.url}", flush=True)
    print(f"  opencode / codex: base URL {model.url}/v1    claude: ANTHROPIC_BASE_URL={model.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        model.serve_forever()
    return 0
