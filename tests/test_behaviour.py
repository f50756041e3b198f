"""The behaviour every backend owes: real CLIs against the loopback model.

Parametrized over every backend that is installed (the `backend` fixture). Each test holds
its own agent and checks, at the end, that no process the agent started is left.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

import shoal
from conftest import leftovers, make_agent, stray, wait_for_request
from shoal.loopback import INPUT_TOKENS, OUTPUT_TOKENS, LoopbackModel
from shoal.prices import PRICES


def requests_with(loopback: LoopbackModel, marker: str) -> list[shoal.loopback.Request]:
    return [r for r in list(loopback.requests) if marker in r.prompt]


def test_turn_writes_file_and_runs_command(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)
        r = s.run("#! write notes/a.txt hello from shoal\n#! run cat notes/a.txt && echo ran > ran.txt")
        assert (workdir / "notes" / "a.txt").read_text().strip() == "hello from shoal"
        assert (workdir / "ran.txt").read_text().strip() == "ran"
        assert r.text == "ok"
        assert r.session_id and r.session_id == s.session_id
        runs = [t for t in r.tool_calls if "cat notes/a.txt" in str(t.input)]
        assert runs and runs[-1].exit_code in (0, None) and "hello from shoal" in runs[-1].output
        # three model calls (write, run, answer) at the loopback's fixed usage and price
        assert r.usage.input_tokens >= 3 * INPUT_TOKENS and r.usage.output_tokens >= 3 * OUTPUT_TOKENS
        price = PRICES["loopback"]
        expect = (r.usage.input_tokens - r.usage.cached_tokens) * price.input + r.usage.output_tokens * price.output
        assert r.usage.cost == pytest.approx((expect + r.usage.cached_tokens * price.cached) / 1e6)
        assert r.seconds > 0
    assert leftovers(agent.id) == []


def test_second_turn_recalls_the_first(backend: str, workdir: Path) -> None:
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)
        s.run("remember: pelican\n#! say noted")
        r = s.run("#! recall")
        assert "pelican" in r.text
        other = agent.session(where=workdir)  # a different conversation does not know it
        assert "pelican" not in other.run("#! recall").text
    assert leftovers(agent.id) == []


def test_eight_sessions_at_once(backend: str, tmp_path: Path, loopback: LoopbackModel) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(8)]
    for d in dirs:
        d.mkdir()
    tag = f"eight-{backend}-{time.time_ns()}"

    async def main() -> list[shoal.Reply]:
        async with make_agent(backend) as agent:
            sessions = [agent.session(where=d) for d in dirs]
            return await asyncio.gather(*(
                s.arun(f"{tag}-{i}\n#! sleep 1\n#! write out.txt {i}\n#! say done {i}") for i, s in enumerate(sessions)
            ))

    replies = asyncio.run(main())
    assert [r.text for r in replies] == [f"done {i}" for i in range(8)]
    assert [(d / "out.txt").read_text().strip() for d in dirs] == [str(i) for i in range(8)]
    # they ran together: some conversation was still going when another had started
    spans = []
    for i in range(8):
        times = [r.t for r in requests_with(loopback, f"{tag}-{i}\n")]
        spans.append((min(times), max(times)))
    overlaps = sum(1 for a in spans for b in spans if a is not b and a[0] < b[1] and b[0] < a[1])
    assert overlaps > 0


def test_turns_on_one_session_queue_in_call_order(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"q-{backend}-{time.time_ns()}"

    async def main() -> list[shoal.Reply]:
        async with make_agent(backend) as agent:
            s = agent.session(where=workdir)
            return await asyncio.gather(
                s.arun(f"{tag}-A\n#! sleep 1.5\n#! say A"), s.arun(f"{tag}-B\n#! say B"), s.arun(f"{tag}-C\n#! say C")
            )

    replies = asyncio.run(main())
    assert [r.text for r in replies] == ["A", "B", "C"]
    a_end = max(r.t for r in requests_with(loopback, f"{tag}-A"))
    b = requests_with(loopback, f"{tag}-B")
    c = requests_with(loopback, f"{tag}-C")
    assert min(r.t for r in b) >= a_end and min(r.t for r in c) >= max(r.t for r in b)


def test_blocking_calls_from_threads_queue_too(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"thr-{backend}-{time.time_ns()}"
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)
        out: dict[str, str] = {}
        first = threading.Thread(target=lambda: out.__setitem__("A", s.run(f"{tag}-A\n#! sleep 1\n#! say A").text))
        first.start()
        wait_for_request(loopback, f"{tag}-A")
        out["B"] = s.run(f"{tag}-B\n#! say B").text  # called second, so it waits for A
        first.join()
    assert out == {"A": "A", "B": "B"}
    assert min(r.t for r in requests_with(loopback, f"{tag}-B")) >= max(
        r.t for r in requests_with(loopback, f"{tag}-A")
    )


def test_blocking_and_awaited_twins_answer_alike(backend: str, workdir: Path) -> None:
    prompt = "#! write f.txt same\n#! run cat f.txt\n#! say twins"
    twin = workdir / "twin"  # the same path, made afresh for each twin: same inputs, same answers
    with make_agent(backend) as agent:
        twin.mkdir()
        blocking = agent.session(where=twin).run(prompt)
        shutil.rmtree(twin)
        twin.mkdir()
        awaited = asyncio.run(agent.session(where=twin).arun(prompt))
    assert blocking == awaited
    assert blocking.session_id != awaited.session_id


def test_awaited_turn_never_blocks_the_loop(backend: str, workdir: Path) -> None:
    async def main() -> tuple[int, shoal.Reply]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.02)

        async with make_agent(backend) as agent:
            t = asyncio.create_task(ticker())
            reply = await agent.session(where=workdir).arun("#! sleep 1.5\n#! say slept")
            stop.set()
            await t
        return ticks, reply

    ticks, reply = asyncio.run(main())
    assert reply.text == "slept"
    # a loop blocked for the turn would tick once or twice; a free one ticks throughout
    assert ticks >= 20


def test_stream_yields_events_then_one_reply(backend: str, workdir: Path) -> None:
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)
        items = list(s.stream("#! run echo streamed\n#! say fin"))

        async def collect() -> list[object]:
            return [ev async for ev in s.stream("#! say again")]

        again = asyncio.run(collect())
    assert isinstance(items[-1], shoal.Reply) and items[-1].text == "fin"
    assert sum(isinstance(i, shoal.Reply) for i in items) == 1
    assert any(isinstance(i, shoal.ToolFinished) and "streamed" in i.output for i in items)
    assert isinstance(again[-1], shoal.Reply) and again[-1].text == "again"


def test_cancelling_an_awaited_turn_stops_every_process(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"cancel-{backend}-{time.time_ns()}"

    async def main() -> str:
        async with make_agent(backend) as agent:
            s = agent.session(where=workdir)
            task = asyncio.create_task(s.arun(f"{tag}\n#! run sleep 30 && echo late > late.txt"))
            await asyncio.to_thread(wait_for_request, loopback, tag)
            await asyncio.sleep(0.5)  # the sleep command is running now, under the CLI
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stray(agent) == []
            return (await s.arun("#! say still here")).text

    assert asyncio.run(main()) == "still here"
    assert not (workdir / "late.txt").exists()


def test_ctrl_c_on_a_blocking_turn_stops_every_process(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"sigint-{backend}-{time.time_ns()}"
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)

        def interrupt() -> None:
            wait_for_request(loopback, tag)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            s.run(f"{tag}\n#! run sleep 30")
        assert stray(agent) == []
        assert s.run("#! say after").text == "after"


def test_turn_timeout_stops_the_turn(backend: str, workdir: Path) -> None:
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)
        with pytest.raises(shoal.TurnTimeout):
            s.run("#! sleep 30", timeout=2)
        assert stray(agent) == []
        assert s.run("#! say ok again").text == "ok again"


def test_provider_error_is_named_and_session_survives(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)
        with pytest.raises(shoal.ProviderError) as info:
            s.run("#! fail 401")
        err = info.value
        assert err.status == 401 or "401" in str(err)
        assert err.request_id is None or err.request_id in {r.request_id for r in loopback.requests}
        assert s.run("#! say recovered").text == "recovered"


def test_killed_cli_is_a_named_error(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"kill-{backend}-{time.time_ns()}"
    with make_agent(backend) as agent:
        s = agent.session(where=workdir)
        s.run("remember: heron")

        def kill_cli() -> None:
            wait_for_request(loopback, tag)
            for pid in shoal.procs.tagged_pids(f"SHOAL_AGENT={agent.id}"):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"sleep" not in f.read():
                        os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill_cli, daemon=True).start()
        with pytest.raises(shoal.TurnFailed):
            s.run(f"{tag}\n#! sleep 20")
        assert "heron" in s.run("#! recall").text  # the next turn picks the conversation up again
    assert leftovers(agent.id) == []
