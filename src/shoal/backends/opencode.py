"""opencode, driven one of two ways (`Settings.transport`):

- "server" (the default): one managed `opencode serve` holds every session of the agent and
  runs their turns at once (`opencode_fleet.py`, `opencode_server.py`). Measured on 2 cores
  it is several times faster than a process per turn and holds one process's memory instead
  of one per turn in flight.
- "run": one `opencode run --format json` process per turn, resumed by its session id.

In "run", the prompt goes in on stdin: opencode reads a piped stdin as the message, which keeps any
prompt (one starting with `-`, one longer than argv allows) intact. Config comes from
`OPENCODE_CONFIG_CONTENT` with project config disabled, and the database is the agent's own
(`OPENCODE_DB`), so nothing of the user's opencode set-up leaks in and nothing of theirs is touched.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shoal.backends.base import Conversation, Settings, base_env, find_cli
from shoal.backends.opencode_events import refused, usage_of
from shoal.backends.opencode_fleet import ServerPool
from shoal.errors import BackendCrashed, BadModel, BadSetting, ProviderError, TurnFailed
from shoal.procs import Proc
from shoal.reply import Event, Notice, Started, StepUsage, Text, ToolFinished, ToolStarted

LOOPBACK_PROVIDER = "shoal"
TRANSPORTS = ("server", "run")
# `opencode run` options the server transport carries in each prompt instead
PROMPT_OPTIONS = {"--agent": "agent", "--model": "model", "-m": "model", "--variant": "variant"}
DB_RETRIES = 5
# what opencode prints when its SQLite database is being created or written by another process
BUSY = re.compile(r"database is locked|SQLITE_BUSY|Failed query", re.IGNORECASE)


class _DatabaseBusy(Exception):
    def __init__(self, code: int, stderr: str) -> None:
        self.code, self.stderr = code, stderr


class OpenCode:
    name = "opencode"
    package = "opencode-ai"
    process_bound = frozenset({"opencode_server"})  # which `opencode serve` the session is on

    def __init__(self, settings: Settings) -> None:
        if settings.model != "loopback" and "/" not in settings.model:
            raise BadModel(
                f"opencode models are named 'provider/model' (e.g. 'anthropic/claude-sonnet-4-5'), "
                f"or 'loopback' for shoal's local model; got {settings.model!r}"
            )
        self.settings = settings
        self.transport = settings.transport or "server"
        if self.transport not in TRANSPORTS:
            raise BadSetting(f"opencode transports are 'server' (one managed `opencode serve` per agent) and "
                             f"'run' (one process per turn); got {self.transport!r}")
        self.cli = find_cli("opencode", self.package)
        self.env = self._env()
        self._db_ready = Path(self.env["OPENCODE_DB"]).exists()
        self._gate = asyncio.Lock()
        self.server: ServerPool | None = None
        if self.transport == "server":
            self.server = ServerPool(self.cli, env=self.env, cwd=settings.home, fields=self._prompt_fields(),
                                     errors=lambda error, sid: _error(error, None, "", sid))

    def _config(self) -> dict[str, Any]:
        s = self.settings
        config: dict[str, Any] = {
            "permission": permission_rules(s.permissions),
            "autoupdate": False,
            "share": "disabled",
        }
        if s.model == "loopback":
            config["provider"] = {
                LOOPBACK_PROVIDER: {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "shoal loopback",
                    "options": {"baseURL": f"{s.base_url}/v1", "apiKey": "loopback"},
                    "models": {"loopback": {"name": "loopback", "tool_call": True,
                                            "limit": {"context": 128000, "output": 4096}}},
                }
            }
            config["model"] = config["small_model"] = f"{LOOPBACK_PROVIDER}/loopback"
        else:
            config["model"] = s.model
        return config

    def _prompt_fields(self) -> dict[str, Any]:
        """`--agent`, `--model`, `--variant` from the settings, as the server's prompt fields."""
        fields: dict[str, Any] = {}
        model = None if self.settings.model == "loopback" else self.settings.model
        args = list(self.settings.args)
        while args:
            arg = args.pop(0)
            flag, eq, value = arg.partition("=")
            if flag not in PROMPT_OPTIONS or not (eq or args):
                raise BadSetting(f"opencode's server transport passes only {', '.join(PROMPT_OPTIONS)} "
                                 f"through; {arg!r} needs transport='run'")
            value = value if eq else args.pop(0)
            if PROMPT_OPTIONS[flag] == "model":
                model = value
            else:
                fields[PROMPT_OPTIONS[flag]] = value
        if model:
            provider, _, name = model.partition("/")
            fields["model"] = {"providerID": provider, "modelID": name}
        return fields

    def _env(self) -> dict[str, str]:
        s = self.settings
        env = base_env(s)
        env.update(
            OPENCODE_CONFIG_CONTENT=json.dumps(self._config()),
            OPENCODE_DB=str(s.home / "opencode.db"),
            OPENCODE_DISABLE_PROJECT_CONFIG="1",
            OPENCODE_DISABLE_AUTOUPDATE="1",
            OPENCODE_DISABLE_LSP_DOWNLOAD="1",
            OPENCODE_DISABLE_SHARE="1",
        )
        if s.model == "loopback":
            env["OPENCODE_DISABLE_MODELS_FETCH"] = "1"  # no catalogue needed for a local model
        env.update(s.env)
        return env

    def _argv(self, conv: Conversation) -> list[str]:
        # ERROR logs on stderr: opencode's JSON error event often says only "Unexpected server error"
        argv = [self.cli, "run", "--format", "json", "--print-logs", "--log-level", "ERROR"]
        if conv.session_id:
            argv += ["--session", conv.session_id]
        else:
            argv += ["--title", "shoal"]  # skips the extra title-generation model call
        if self.settings.model != "loopback":
            argv += ["--model", self.settings.model]
        return argv + self.settings.args

    def held_pids(self) -> list[int]:
        """Processes this backend keeps running between turns by design (its servers)."""
        return self.server.pids() if self.server is not None else []

    async def turn(self, conv: Conversation, prompt: str) -> AsyncIterator[Event]:
        if self.server is not None:
            async for ev in self.server.turn(conv, prompt):
                yield ev
            return
        for attempt in range(DB_RETRIES + 1):
            attempt_events = self._attempt(conv, prompt)
            try:
                async for ev in attempt_events:
                    yield ev
                return
            except _DatabaseBusy as busy:
                if attempt == DB_RETRIES:
                    raise BackendCrashed("opencode's database stayed busy", backend=self.name,
                                         exit_code=busy.code, stderr_tail=busy.stderr) from None
                delay = 0.25 * 2**attempt
                yield Notice("retry", f"opencode database busy before the turn began; retrying in {delay:.2f} s")
                await asyncio.sleep(delay)

    async def _attempt(self, conv: Conversation, prompt: str) -> AsyncIterator[Event]:
        # A fresh database is created by the first process that opens it; several creating it
        # at once collide on its migrations. So the agent's first process goes alone until it
        # has said something, and the rest follow.
        gate = None if self._db_ready else self._gate
        if gate is not None:
            await gate.acquire()
            if self._db_ready:
                gate.release()
                gate = None
        proc = await Proc.spawn(self._argv(conv), cwd=conv.cwd, env={**self.env, **conv.env}, stdin=True)
        error: dict[str, Any] | None = None
        said_anything = False
        try:
            await proc.write(prompt.encode(), close=True)
            while line := await proc.readline():
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # opencode prints the odd non-JSON line; the JSON ones are the record
                if gate is not None:
                    self._db_ready = True
                    gate.release()
                    gate = None
                said_anything = True
                if not conv.session_id and event.get("sessionID"):
                    conv.session_id = event["sessionID"]
                    yield Started(conv.session_id)
                if event.get("type") == "error":
                    error = event.get("error") or {}
                    continue
                for ev in _events(event):
                    yield ev
            code = await proc.wait()
        except BaseException:
            await proc.stop()
            raise
        finally:
            if gate is not None:
                gate.release()
        if error is not None:
            raise _error(error, code, proc.stderr_tail(), conv.session_id)
        if code != 0:
            tail = proc.stderr_tail()
            if not said_anything and BUSY.search(tail):
                raise _DatabaseBusy(code, tail)
            raise BackendCrashed("opencode exited without an answer", backend=self.name, exit_code=code,
                                 stderr_tail=tail, session_id=conv.session_id)

    def log(self, conv: Conversation) -> Path | None:
        """opencode keeps every session of the agent in one SQLite file (`opencode export <id>` reads it)."""
        return Path(self.env["OPENCODE_DB"]) if conv.session_id else None

    async def end(self, conv: Conversation) -> None:
        if self.server is not None:
            await self.server.end(conv)

    async def aclose(self) -> None:
        if self.server is not None:
            await self.server.close()


def permission_rules(permissions: dict[str, str]) -> dict[str, Any]:
    """shoal's rules as opencode's `permission` config; nothing is left on "ask".

    `{"bash": "allow", "bash:rm *": "deny"}` (tool, or tool:pattern) becomes
    `{"bash": {"*": "allow", "rm *": "deny"}}`: opencode lets the last matching rule win, so the
    tool's blanket rule goes first and its patterns after it.
    """
    rules: dict[str, Any] = {}
    for key, action in permissions.items():
        action = "deny" if action == "ask" else action  # headless: asking would wait for nobody
        if action not in ("allow", "deny"):
            raise BadSetting(f"permission {key!r}: {action!r} is not allow, deny or ask")
        tool, pattern = key.split(":", 1) if ":" in key else (key, "")
        held = rules.get(tool)
        if not pattern:
            rules[tool] = {"*": action, **{k: v for k, v in held.items() if k != "*"}} if isinstance(held, dict) \
                else action
        else:
            rules[tool] = {**({"*": held} if isinstance(held, str) else held or {}), pattern: action}
    return rules


def _events(event: dict[str, Any]) -> list[Event]:
    part = event.get("part") or {}
    kind = event.get("type")
    if kind == "text" and part.get("text"):
        return [Text(part["text"])]
    if kind == "tool_use":
        state = part.get("state") or {}
        meta = state.get("metadata") or {}
        call_id, tool, args = part.get("callID", ""), part.get("tool", ""), state.get("input") or {}
        failed = state.get("status") == "error"
        output = str(state.get("error") if failed else state.get("output", ""))
        exit_code = meta.get("exit")
        return [ToolStarted(call_id, tool, args),
                ToolFinished(call_id, tool, args, output, exit_code, ok=not failed and exit_code in (None, 0)),
                *(refused(tool, args, output) if failed else [])]
    if kind == "step_finish":
        return [StepUsage(usage_of(part))]
    return []


def _error(error: dict[str, Any], code: int | None, stderr: str, session_id: str | None) -> TurnFailed:
    data = error.get("data") or {}
    message = str(data.get("message") or error.get("name") or "opencode reported an error")
    headers = data.get("responseHeaders") or {}
    request_id = headers.get("x-request-id") or headers.get("request-id")
    status = data.get("statusCode")
    name = str(error.get("name", ""))
    common: dict[str, Any] = {"backend": "opencode", "exit_code": code, "stderr_tail": stderr,
                              "request_id": request_id, "session_id": session_id}
    if status is not None or name == "APIError":
        hint = {401: " (check the provider's API key)", 429: " (rate limited; retry later)"}.get(status or 0, "")
        return ProviderError(f"provider error {status}: {message}{hint}", status=status, **common)
    logged = re.findall(r'error="([^"]+)"', stderr)
    if logged:
        message = logged[-1]
    if "ModelNotFound" in message or "ProviderNotFound" in message:
        return TurnFailed(f"opencode does not know this model: {message} Name one that "
                          "`opencode models` lists, as provider/model.", **common)
    return TurnFailed(f"opencode: {name}: {message}", **common)
