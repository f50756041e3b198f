"""Claude Code, driven headless through `claude -p --output-format stream-json`.

Two transports (`Settings.transport`):

* "held" (default): one `claude -p --input-format stream-json` process per session, started
  by its first turn and fed one JSON user message per turn; a turn ends at its `result` line.
  Warm turns skip the CLI's start-up (about 0.5 s), so this is the fast path.
* "run": one process per turn, prompt on stdin, `--resume <id>` after the first.

Either way the conversation id is chosen up front (`--session-id`) and Claude Code keeps the
transcript under the agent's HOME, so any process that dies — killed, cancelled, failed —
is simply replaced by one started with `--resume`: the conversation goes on where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shoal.backends.base import Conversation, Settings, base_env, find_cli
from shoal.errors import BackendCrashed, BadSetting, ProtocolMismatch, ProviderError, TurnFailed
from shoal.procs import Proc
from shoal.reply import Event, Notice, Started, StepUsage, Text, ToolFinished, ToolStarted, Usage

PINNED = "2.1.332"  # the version this module's reading of stream-json was checked against
TRANSPORTS = ("held", "run")
# A model name Claude Code knows (an unknown one draws a stderr warning and a smaller
# max_tokens); the loopback model answers to any name, and pricing keys on settings.model.
LOOPBACK_MODEL = "claude-sonnet-4-5"
# Credentials a real model needs; base_env passes nothing of the user's, so name them here.
CREDENTIALS = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN")
# shoal permission keys -> Claude Code tool names. "external_directory" is not a tool: it
# picks the permission mode (see `_permission_args`).
TOOLS: dict[str, tuple[str, ...]] = {
    "edit": ("Edit", "Write", "NotebookEdit"),
    "bash": ("Bash",),
    "webfetch": ("WebFetch", "WebSearch"),
    "question": ("AskUserQuestion",),
    "read": ("Read",),
    "glob": ("Glob",),
    "grep": ("Grep",),
    "task": ("Task",),
}
# Claude Code retries even 401/403 ten times with backoff (minutes); bad credentials never heal.
NO_RETRY = (401, 403)
EXIT_CODE = re.compile(r"^Exit code (\d+)")


class _WrongStart(TurnFailed):
    """--resume found no transcript, or --session-id found one: start the other way."""


class Claude:
    name = "claude"
    package = "@anthropic-ai/claude-code"
    process_bound = frozenset({"proc"})  # the CLI held open between turns
    init_timeout = 60.0  # from sending a prompt to the CLI's first line (start-up, not the model)

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.transport = settings.transport or "held"
        if self.transport not in TRANSPORTS:
            raise BadSetting(f"claude transports are {', '.join(TRANSPORTS)}; got {self.transport!r}")
        self.cli = find_cli("claude", self.package)
        self.env = self._env()
        self._held: set[Proc] = set()
        self._version: str | None = None

    def _env(self) -> dict[str, str]:
        s = self.settings
        env = base_env(s)
        env.update(
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",  # no telemetry, no /api/hello probe
            IS_SANDBOX="1",  # bypassPermissions refuses to run as root without it
            DISABLE_AUTOUPDATER="1",
            # A turn must be whole at its result line: a background shell would report after it
            # (into the next turn's output, held) or die with the process (run). This also lifts
            # the block on long leading `sleep` commands, a nudge towards backgrounding them.
            CLAUDE_CODE_DISABLE_BACKGROUND_TASKS="1",
        )
        if s.base_url:
            env["ANTHROPIC_BASE_URL"] = s.base_url
        if s.model == "loopback":
            env["ANTHROPIC_API_KEY"] = "dummy"
        else:
            env.update({k: os.environ[k] for k in CREDENTIALS if k in os.environ})
        env.update(s.env)
        return env

    def _permission_args(self) -> list[str]:
        perms = self.settings.permissions
        # bypassPermissions lets every tool touch any path. acceptEdits grants edits inside the
        # session's directory only (outside it -p auto-denies), and allowed tools run unasked.
        mode = "bypassPermissions" if perms.get("external_directory") == "allow" else "acceptEdits"
        # An allowed "Write" rule would grant writes everywhere: edits are the mode's to allow.
        allowed = [t for key, tools in TOOLS.items() if perms.get(key) == "allow" and key != "edit" for t in tools]
        denied = [t for key, tools in TOOLS.items() if perms.get(key) == "deny" for t in tools]
        # Keys already spelled as Claude Code rules ("Bash(git *)", "Read") pass through.
        allowed += [k for k, v in perms.items() if k[:1].isupper() and v == "allow"]
        denied += [k for k, v in perms.items() if k[:1].isupper() and v == "deny"]
        args = ["--permission-mode", mode]
        if allowed:
            args.append("--allowedTools=" + ",".join(allowed))  # `=`: the flag is variadic
        if denied:
            args.append("--disallowedTools=" + ",".join(denied))
        return args

    def _argv(self, conv: Conversation) -> list[str]:
        s = self.settings
        argv = [self.cli, "-p", "--output-format", "stream-json", "--verbose",
                "--model", LOOPBACK_MODEL if s.model == "loopback" else s.model]
        if self.transport == "held":
            argv += ["--input-format", "stream-json"]
        assert conv.session_id is not None
        argv += ["--resume" if conv.state.get("resume") else "--session-id", conv.session_id]
        return argv + self._permission_args() + s.args

    # --- turns ---------------------------------------------------------------------------

    async def turn(self, conv: Conversation, prompt: str) -> AsyncIterator[Event]:
        if conv.session_id is None:
            conv.session_id = str(uuid.uuid4())
            yield Started(conv.session_id)
        for attempt in (1, 2):
            proc = conv.state.get("proc")
            if proc is not None and proc.returncode is not None:
                await self._drop(conv)  # died between turns: replace it, the transcript remains
                yield Notice("restart", f"claude process {proc.pid} had exited; resuming in a new one")
                proc = None
            if proc is None:
                proc = await self._spawn(conv)
            try:
                await self._send(proc, prompt)
                async for ev in self._read(proc, conv):
                    yield ev
                if self.transport == "run":  # let it exit on its own (it may still be saving)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(proc.wait(), 5)
                    await self._drop(conv)
                return
            except _WrongStart:
                await self._drop(conv)
                conv.state["resume"] = not conv.state.get("resume")
                if attempt == 2:
                    raise
            except BaseException:
                # Failed, cancelled or abandoned: whatever this process would still print
                # belongs to this turn, so it must not live on to be read by the next one.
                await self._drop(conv)
                raise

    async def _spawn(self, conv: Conversation) -> Proc:
        proc = await Proc.spawn(self._argv(conv), cwd=conv.cwd, env={**self.env, **conv.env}, stdin=True)
        conv.state["proc"] = proc
        if self.transport == "held":
            self._held.add(proc)
        return proc

    async def _send(self, proc: Proc, prompt: str) -> None:
        if self.transport == "held":
            data = json.dumps({"type": "user", "message": {"role": "user", "content": prompt}}) + "\n"
        else:
            data = prompt  # stdin keeps any prompt intact (a leading "-", more than argv holds)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await proc.write(data.encode(), close=self.transport == "run")
        # a process that is already gone shows up in _read as an early end of output

    async def _drop(self, conv: Conversation) -> None:
        proc: Proc | None = conv.state.pop("proc", None)
        if proc is not None:
            self._held.discard(proc)
            await proc.stop()

    async def _read(self, proc: Proc, conv: Conversation) -> AsyncIterator[Event]:
        """This turn's events, up to and including its `result` line."""
        tools: dict[str, tuple[str, dict[str, Any]]] = {}  # tool_use id -> (name, input)
        request_id: str | None = None
        seen = False
        while True:
            if seen:
                line = await proc.readline()
            else:
                try:
                    line = await asyncio.wait_for(proc.readline(), self.init_timeout)
                except TimeoutError:
                    raise await self._mismatch(proc, f"no output {self.init_timeout:.0f} s after the prompt") from None
            if not line:
                raise await self._ended(proc, conv, seen)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict) or "type" not in event:
                if not seen:
                    raise await self._mismatch(proc, f"first line is not a stream-json event: {line[:200]!r}")
                continue
            seen = True
            conv.state["resume"] = True  # the CLI took the prompt: from now on the transcript exists
            if event.get("parent_tool_use_id"):
                continue  # a subagent's inner steps: its outcome arrives as the Task tool's result
            kind = event["type"]
            if kind == "result":
                if event.get("is_error") or str(event.get("subtype", "")).startswith("error"):
                    raise _failure(event, proc, conv.session_id, request_id)
                yield StepUsage(_usage(event))
                return
            if kind == "system" and event.get("subtype") == "api_retry":
                status = event.get("error_status")
                if status in NO_RETRY:
                    raise ProviderError(f"provider error {status}: {event.get('error')} (check the API key)",
                                        status=status, **_common(proc, conv.session_id, None))
                yield Notice("retry", f"model API error {status or event.get('error')}; claude retries "
                                      f"(attempt {event.get('attempt')} of {event.get('max_retries')})")
            elif kind == "system" and event.get("subtype") == "permission_denied":
                yield Notice("permission_denied", str(event.get("message", "")))
            elif kind == "assistant":
                if event.get("is_api_error_message"):  # the CLI's own "API Error: ..." text
                    request_id = event.get("request_id") or request_id
                    continue
                for block in (event.get("message") or {}).get("content") or []:
                    if block.get("type") == "text" and block.get("text"):
                        yield Text(block["text"])
                    elif block.get("type") == "tool_use":
                        call = (str(block.get("name", "")), dict(block.get("input") or {}))
                        tools[str(block.get("id"))] = call
                        yield ToolStarted(str(block.get("id")), *call)
            elif kind == "user":
                content = (event.get("message") or {}).get("content")
                for block in content if isinstance(content, list) else []:
                    if block.get("type") == "tool_result":
                        yield _finished(block, tools)

    # --- failures ------------------------------------------------------------------------

    async def _ended(self, proc: Proc, conv: Conversation, seen: bool) -> TurnFailed | ProtocolMismatch:
        """Output ended before the turn's result: why?"""
        try:
            code: int | None = await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            code = None
        if "is already in use" in proc.stderr_tail():
            return _WrongStart("claude: session id already in use", **_common(proc, conv.session_id, None))
        if not seen and code not in (None, 0):
            found = await self.version()
            if found != PINNED:
                return ProtocolMismatch(f"claude {found} exited before its first stream-json event; shoal "
                                        f"speaks to Claude Code {PINNED} (`bash scripts/setup.sh` in the "
                                        f"shoal checkout installs it)\n" + proc.stderr_tail())
        return BackendCrashed("claude exited mid-turn", backend=self.name, exit_code=code,
                              stderr_tail=proc.stderr_tail(), session_id=conv.session_id)

    async def _mismatch(self, proc: Proc, what: str) -> ProtocolMismatch:
        found = await self.version()
        return ProtocolMismatch(f"{self.cli} (version {found}) does not speak the stream-json shoal expects "
                                f"from Claude Code {PINNED}: {what}")

    async def version(self) -> str:
        """`claude --version`'s number, or what went wrong asking; remembered once known."""
        if self._version is None:
            self.settings.home.mkdir(parents=True, exist_ok=True)
            proc = await Proc.spawn([self.cli, "--version"], cwd=self.settings.home, env=self.env)
            try:
                out = await asyncio.wait_for(proc.readline(), 10)
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                return "unknown (`claude --version` did not answer)"
            finally:
                await proc.stop()
            self._version = out.decode(errors="replace").split(" ", 1)[0].strip() or "unknown"
        return self._version

    # --- the session's and the agent's end ---------------------------------------------------

    def log(self, conv: Conversation) -> Path | None:
        """`$HOME/.claude/projects/<cwd, every other character a dash>/<session id>.jsonl`."""
        if conv.session_id is None:
            return None
        projects = self.settings.home / ".claude" / "projects"
        # claude shortens very long directory names; the id alone then finds the file
        found = next(projects.glob(f"*/{conv.session_id}.jsonl"), None)
        return found or projects / re.sub(r"[^A-Za-z0-9]", "-", str(conv.cwd)) / f"{conv.session_id}.jsonl"

    async def end(self, conv: Conversation) -> None:
        proc: Proc | None = conv.state.get("proc")
        if proc is not None:
            # EOF on stdin is the CLI's own way out: it finishes writing its transcript and exits
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
                await proc.write(b"", close=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 2)
        await self._drop(conv)

    async def aclose(self) -> None:
        held, self._held = list(self._held), set()
        await asyncio.gather(*(p.stop() for p in held), return_exceptions=True)


def _finished(block: dict[str, Any], tools: dict[str, tuple[str, dict[str, Any]]]) -> ToolFinished:
    call_id = str(block.get("tool_use_id", ""))
    tool, args = tools.get(call_id, ("", {}))
    content = block.get("content")
    if isinstance(content, list):  # text and image parts
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    output, failed = str(content or ""), bool(block.get("is_error"))
    exit_code: int | None = None
    if tool == "Bash":  # Claude Code reports a non-zero exit as "Exit code N" and zero by silence
        m = EXIT_CODE.match(output)
        exit_code = int(m.group(1)) if m else (None if failed else 0)
    return ToolFinished(call_id, tool, args, output, exit_code, ok=not failed)


def _usage(result: dict[str, Any]) -> Usage:
    """The turn's usage from its `result` line (the per-message figures would count twice)."""
    u = result.get("usage") or {}
    cached = int(u.get("cache_read_input_tokens") or 0)
    # Anthropic's input_tokens excludes cached and cache-writing input; shoal counts all input.
    total_in = int(u.get("input_tokens") or 0) + cached + int(u.get("cache_creation_input_tokens") or 0)
    # total_cost_usd adds up over a held process's life; the per-turn figure is in model usage
    per_model = result.get("model_usage_since_last_result")
    if isinstance(per_model, dict):
        cost = sum(float(m.get("costUSD") or 0) for m in per_model.values() if isinstance(m, dict))
    else:
        cost = float(result.get("total_cost_usd") or 0)
    return Usage(total_in, int(u.get("output_tokens") or 0), cached, cost)


def _common(proc: Proc, session_id: str | None, request_id: str | None) -> dict[str, Any]:
    return {"backend": "claude", "exit_code": proc.returncode, "stderr_tail": proc.stderr_tail(),
            "request_id": request_id, "session_id": session_id}


def _failure(result: dict[str, Any], proc: Proc, session_id: str | None, request_id: str | None) -> TurnFailed:
    errors = [str(e) for e in result.get("errors") or []]
    message = str(result.get("result") or "; ".join(errors) or result.get("subtype") or "claude reported an error")
    common = _common(proc, session_id, request_id)
    if any("No conversation found" in e for e in errors):
        return _WrongStart(f"claude: {message}", **common)
    status = result.get("api_error_status")
    if status is not None or result.get("api_error") or result.get("terminal_reason") == "api_error":
        return ProviderError(f"provider error {status or result.get('api_error')}: {message}", status=status, **common)
    return TurnFailed(f"claude: {message}", **common)
