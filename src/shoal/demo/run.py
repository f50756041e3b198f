"""The demo itself, as a coroutine: data in (how many, which backend), results out.

Every conversation does real work through the loopback model: turn one writes a module into
its own copy of the sample project and runs a checker that imports it; turn two asks the
model to recall a marker given only in turn one, proving the conversation came back whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import shoal
from shoal.places.copy import Copy

SAMPLE = Path(__file__).parent / "sample"


@dataclass
class Conversation:
    index: int
    status: str = "queued"
    doing: str = ""
    place: str = ""
    files_changed: list[str] = field(default_factory=list)
    tokens: int = 0
    cost: float = 0.0
    seconds: float = 0.0  # sum of this conversation's turn times
    ok: bool = False
    problem: str = ""


@dataclass
class Outcome:
    conversations: list[Conversation]
    wall: float
    backend: str
    kept: list[str]

    @property
    def turn_seconds(self) -> float:
        return sum(c.seconds for c in self.conversations)


def prompts(i: int) -> tuple[str, str]:
    first = (
        f"remember: marker-{i}\n"
        f"#! write app/feature_{i}.py def value():\\n    return {i} * 7\n"
        f"#! run python3 check.py {i}\n"
        f"#! say feature {i} ready"
    )
    return first, "#! recall"


async def conversation(agent: shoal.Agent, conv: Conversation, changed: Callable[[], None]) -> None:
    place = Copy(SAMPLE, keep="never")
    session = agent.session(where=place, name=f"c{conv.index:02d}")
    for prompt in prompts(conv.index):
        conv.status = "working"
        changed()
        async for item in session.stream(prompt):
            if isinstance(item, shoal.ToolStarted):
                conv.doing = f"{item.tool}"
            elif isinstance(item, shoal.Reply):
                conv.tokens += item.usage.total_tokens
                conv.cost += item.usage.cost
                conv.seconds += item.seconds
                conv.doing = item.text.splitlines()[0] if item.text else ""
            changed()
    conv.place = place.describe()
    conv.files_changed = place.changes()
    result = Path(place.describe()) / "result.txt"
    expected = str(conv.index * 7)
    conv.ok = result.exists() and result.read_text().strip() == expected and f"marker-{conv.index}" in conv.doing
    if not conv.ok:
        conv.problem = "wrong result or nothing recalled"
    conv.status = "done" if conv.ok else "failed"
    changed()


async def demo(
    n: int = 12, backend: str = "opencode", on_change: Callable[[list[Conversation]], None] = lambda convs: None
) -> Outcome:
    """Run `n` conversations at once; `on_change` sees every conversation whenever one moves."""
    convs = [Conversation(i) for i in range(n)]

    def changed() -> None:
        on_change(convs)

    started = time.monotonic()
    async with shoal.Agent(backend, model="loopback") as agent:

        async def guarded(conv: Conversation) -> None:
            try:
                await conversation(agent, conv, changed)
            except shoal.ShoalError as exc:
                conv.status, conv.problem = "failed", str(exc).splitlines()[0]
                changed()

        await asyncio.gather(*(guarded(c) for c in convs))
    return Outcome(convs, time.monotonic() - started, backend, agent.kept)
