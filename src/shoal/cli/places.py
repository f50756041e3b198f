"""`shoal places`: what shoal made (worktrees, copies, containers, ssh mounts) and what each holds.

`shoal places clean` removes only what is safe to remove — nothing in use by a running
shoal, nothing holding uncommitted changes or commits on no other branch, no copy with
changed files — and says, for each place it kept, why. It also removes the private CLI
homes of agents whose shoal is gone without closing them (killed outright): an open agent
holds its home (`shoal.homes`), so one nobody holds is left over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType

from shoal import homes
from shoal.places import container, copy, registry, ssh, worktree

KINDS: dict[str, ModuleType] = {"worktree": worktree, "copy": copy, "container": container, "ssh": ssh}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("places", help="list the worktrees, copies, containers and ssh mounts shoal made")
    p.add_argument("action", nargs="?", choices=["list", "clean"], default="list",
                   help="list (default), or clean: remove what is safe to remove and say what was kept")
    p.add_argument("--json", action="store_true", help="list as JSON lines")
    p.add_argument("--dry-run", action="store_true", help="with clean: say what would be removed, remove nothing")
    p.set_defaults(func=main)


def _gone(entry: registry.Entry) -> bool:
    """Its directory no longer exists (removed by hand): nothing left to keep or remove."""
    return entry["kind"] in ("worktree", "copy") and not Path(entry["path"]).exists()


async def _holds(entry: registry.Entry) -> str:
    module = KINDS.get(entry["kind"])
    if module is None:
        return f"unknown kind {entry['kind']!r}"
    if _gone(entry):
        return "gone (removed by hand)"
    try:
        fn: Callable[[registry.Entry], Awaitable[str]] = module.holds
        return await fn(entry)
    except Exception as exc:  # one unreadable place must not hide the others
        return f"cannot tell ({exc})"


def _left_homes() -> list[Path]:
    return homes.orphaned(homes.agents_dir())


def _home_line(home: Path) -> str:
    ago = max(0.0, time.time() - home.stat().st_mtime) / 60
    return f"{homes.size(home) / 1e6:.1f} MB, last used {ago:.0f} min ago; its shoal is gone"


async def _list(as_json: bool) -> int:
    entries = registry.entries()
    left = _left_homes()
    if not entries and not left and not as_json:
        print("shoal has made no places that are still here.")
    for home in left:
        if as_json:
            print(json.dumps({"kind": "agent-home", "path": str(home), "state": "left over",
                              "holds": _home_line(home)}))
        else:
            print(f"{'agent ' + home.name:<22} {'left over':<16} {home}\n{'':<22} {_home_line(home)}")
    for entry in entries:
        state = f"in use by pid {entry['pid']}" if registry.in_use(entry) else entry.get("status", "?")
        holds = await _holds(entry)
        if as_json:
            print(json.dumps({**entry, "state": state, "holds": holds}))
        else:
            print(f"{entry['id']:<22} {state:<16} {entry['path']}\n{'':<22} {holds}")
    return 0


async def _clean(dry_run: bool) -> int:
    removed = kept = 0
    for entry in registry.entries():
        where = f"{entry['kind']} {entry['path']}"
        if registry.in_use(entry):
            print(f"kept     {where}: in use by a running shoal (pid {entry['pid']})")
            kept += 1
            continue
        if _gone(entry):
            if not dry_run:
                registry.remove(entry["id"])
            print(f"forgot   {where}: already gone")
            continue
        module = KINDS.get(entry["kind"])
        if module is None:
            print(f"kept     {where}: unknown kind {entry['kind']!r}")
            kept += 1
            continue
        if dry_run:
            print(f"would check {where}: {await _holds(entry)}")
            continue
        try:
            ok, why = await module.clean(entry)
        except Exception as exc:
            ok, why = False, f"could not be checked ({exc})"
        if ok:
            registry.remove(entry["id"])
            removed += 1
        else:
            registry.update(entry["id"], status="kept", holds=why)
            kept += 1
        print(f"{'removed' if ok else 'kept':<8} {where}: {why}")
    for home in _left_homes():
        if dry_run:
            print(f"would remove agent home {home}: {_home_line(home)}")
            continue
        await asyncio.to_thread(shutil.rmtree, home, True)
        print(f"removed  agent home {home}: its shoal is gone without closing it")
        removed += 1
    print(f"{removed} removed, {kept} kept")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.action == "clean":
        return asyncio.run(_clean(args.dry_run))
    return asyncio.run(_list(args.json))
