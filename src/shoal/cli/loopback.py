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

    model = LoopbackModel(port=args.port, log_path=args.log)
    model.start()
    print(f"shoal loopback model on {model.url}", flush=True)
    print(f"  opencode / codex: base URL {model.url}/v1    claude: ANTHROPIC_BASE_URL={model.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        model.serve_forever()
    return 0
