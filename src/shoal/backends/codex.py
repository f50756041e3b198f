"""Codex CLI, two ways: one `codex app-server` per agent ("server", the default) or one
`codex exec --json` process per turn ("run"), resumed by thread id (`codex exec resume`).

Each agent gets a CODEX_HOME of its own (`settings.home / "codex"`, outside /tmp so codex
does not refuse to put its helper binaries there) holding a config.toml shoal writes, so
nothing of the user's codex set-up leaks in. Approvals are always "never": nothing may wait
for a human. The sandbox follows the agent's permissions (see `sandbox_mode`).

For the loopback model codex is told a built-in model slug (`LOOPBACK_SLUG`): with an
unknown slug codex drops its instructions and the freeform `apply_patch` tool. shoal's own
`settings.model` stays "loopback", which is what pricing keys on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shoal.backends.base import Conversation, Settings, base_env, find_cli
from shoal.backends.codex_appserver import NO_ROLLOUT, ServerTransport
from shoal.errors import BackendCrashed, BadModel, BadSetting, ProtocolMismatch, ProviderError, TurnFailed
from shoal.procs import Proc
from shoal.reply import Event, Notice, Started, StepUsage, Text, ToolFinished, ToolStarted, Usage

PINNED = "0.171.0"  # package.json pins @openai/codex; the app-server protocol changes between minors
LOOPBACK_SLUG = "gpt-5.5"
PROVIDER = "shoal"  # the model_providers entry for the loopback (or an OpenAI API key)
KEY_VAR = "SHOAL_CODEX_API_KEY"
# Codex retries a failed model request with backoff, 5 times by default (~6.5 s for a
# scripted 401). Against the loopback two retries keep `#! fail 500 2` recoverable and make
# a permanent failure cost under a second. Real providers keep codex's defaults.
LOOPBACK_RETRIES = 2
SANDBOXES = ("read-only", "workspace-write", "danger-full-access")
STATUS_OF = {"unauthorized": 401, "rateLimitExceeded": 429, "usageLimitExceeded": 429, "badRequest": 400,
             "internalServerError": 500, "serverOverloaded": 503, "modelNotFound": 404}
# codexErrorInfo values that are not about the model provider (everything else is)
NOT_PROVIDER = {"other", "sandboxError", "threadRollbackFailed", "tooManyDenials", "activeTurnNotSteerable"}
# `codex exec` reports only a message; these are the ones a provider (or the way to it) caused
PROVIDER_MESSAGE = re.compile(r"unexpected status|retry limit|high demand|stream disconnected|error sending request"
                              r"|rate limit|quota|unauthorized", re.I)
REQUEST_ID = re.compile(r"request[ _-]id:?\s*([\w-]+)", re.I)
HTTP_STATUS = re.compile(r"\bstatus:?\s*(\d{3})\b")


def sandbox_mode(permissions: dict[str, str]) -> str:
    """Codex's sandbox for shoal's permission rules.

    Denying edits or the shell gives "read-only": codex cannot drop its shell tool, but the
    sandbox makes every write (apply_patch or a command's) fail. Otherwise "danger-full-access":
    the "workspace-write" sandbox would honour `external_directory: deny`, but it needs
    bubblewrap/Landlock and user namespaces, which containers often lack, and then every
    command fails. Ask for it (or any mode) explicitly with `permissions={"sandbox": MODE}`.
    """
    explicit = permissions.get("sandbox")
    if explicit in SANDBOXES:
        return str(explicit)
    if permissions.get("edit") == "deny" or permissions.get("bash") == "deny":
        return "read-only"
    return "danger-full-access"


class Codex:
    name = "codex"
    package = "@openai/codex"
    process_bound = frozenset({"codex_server"})  # which app-server has the thread loaded

    def __init__(self, settings: Settings) -> None:
        model = settings.model
        if not model or model.startswith("/") or model.endswith("/"):
            raise BadModel(f"codex models are named 'model' or 'provider/model' (e.g. 'gpt-5.5'), "
                           f"or 'loopback' for shoal's local model; got {model!r}")
        transport = settings.transport or "server"
        if transport not in ("server", "run"):
            raise BadSetting(f"codex transports are 'server' (one app-server per agent) and 'run' "
                             f"(one process per turn); got {transport!r}")
        self.settings = settings
        self.transport = transport
        self.cli, managed = native(find_cli("codex", self.package))
        self.home = settings.home / "codex"
        self.sandbox = sandbox_mode(settings.permissions)
        self.env = {**self._env(), **managed}
        self.version = ""
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self.server = ServerTransport(
            [self.cli, "app-server", *settings.args], cwd=self.home, env=self.env,
            thread_params={"approvalPolicy": "never", "sandbox": self.sandbox},
            version=lambda: self.version, pinned=PINNED, mapper=ServerTurn)

    # --- set-up --------------------------------------------------------------------------------

    def _model(self) -> tuple[str, str | None]:
        """(model, provider) as codex should see them; provider None means codex's default."""
        s = self.settings
        if s.model == "loopback":
            return LOOPBACK_SLUG, PROVIDER
        provider, _, model = s.model.rpartition("/")
        if provider in ("", "openai") and self.env.get("OPENAI_API_KEY"):
            return model, PROVIDER  # an API key in the environment: no `codex login` needed
        return model, provider or None

    def _config(self) -> str:
        s = self.settings
        model, provider = self._model()
        q = json.dumps  # a JSON string is a valid TOML basic string
        lines = [f"model = {q(model)}"]
        if provider:
            lines.append(f"model_provider = {q(provider)}")
        lines += ['approval_policy = "never"', f"sandbox_mode = {q(self.sandbox)}",
                  "check_for_update_on_startup = false"]
        if provider == PROVIDER:
            loopback = s.model == "loopback"
            base = f"{s.base_url}/v1" if loopback else "https://api.openai.com/v1"
            lines += [f"[model_providers.{PROVIDER}]", f"name = {q('shoal loopback' if loopback else 'OpenAI')}",
                      f"base_url = {q(base)}", 'wire_api = "responses"',
                      f"env_key = {q(KEY_VAR if loopback else 'OPENAI_API_KEY')}"]
            if loopback:
                lines += [f"stream_max_retries = {LOOPBACK_RETRIES}", f"request_max_retries = {LOOPBACK_RETRIES}"]
        # analytics off: its OTLP export blocks exit ~5 s without network; plugins off: no
        # start-up sync with github.com and chatgpt.com
        lines += ["[analytics]", "enabled = false", "[features]", "plugins = false"]
        return "\n".join(lines) + "\n"

    def _env(self) -> dict[str, str]:
        s = self.settings
        env = base_env(s)
        env["CODEX_HOME"] = str(self.home)
        if s.model == "loopback":
            env[KEY_VAR] = "loopback"
        elif os.environ.get("OPENAI_API_KEY"):
            env["OPENAI_API_KEY"] = os.environ["OPENAI_API_KEY"]  # the agent's own env= still wins below
        env.update(s.env)
        return env

    async def _prepare(self) -> None:
        """Once per agent, on its first turn: check the CLI's version, write CODEX_HOME."""
        async with self._ready_lock:
            if self._ready:
                return
            self.home.mkdir(parents=True, exist_ok=True)
            self.version = await self._check_version()
            (self.home / "config.toml").write_text(self._config())
            self._ready = True

    async def _check_version(self) -> str:
        proc = await Proc.spawn([self.cli, "--version"], cwd=self.home, env=self.env)
        try:
            async with asyncio.timeout(15):
                out = b"".join([line async for line in _lines(proc)]).decode(errors="replace")
                await proc.wait()
        except TimeoutError:
            out = ""
        finally:
            await proc.stop()
        m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
        found = m.group(0) if m else (out.strip() or "an unknown version")
        if not m or found.split(".")[:2] != PINNED.split(".")[:2]:
            raise ProtocolMismatch(
                f"{self.cli} is codex {found}, but shoal speaks the protocol of codex {PINNED} "
                f"({'.'.join(PINNED.split('.')[:2])}.x). Install the pinned CLI with `bash scripts/setup.sh` "
                f"in the shoal checkout, or point SHOAL_CODEX_BIN at a codex {PINNED}.")
        return found

    # --- turns ---------------------------------------------------------------------------------

    async def turn(self, conv: Conversation, prompt: str) -> AsyncIterator[Event]:
        await self._prepare()
        if self.transport == "server":
            async for ev in self.server.turn(conv, prompt):
                yield ev
            return
        try:
            async for ev in self._run(conv, prompt):
                yield ev
        except BackendCrashed as exc:
            if NO_ROLLOUT not in exc.stderr_tail or not conv.session_id:
                raise
            # The first turn died before codex saved the thread: there is no history to lose.
            old, conv.session_id = conv.session_id, None
            conv.state.pop("codex_total", None)
            async for ev in self._run(conv, prompt):
                yield Notice("new-thread", f"codex thread {old} was never saved; continuing in {ev.session_id}") \
                    if isinstance(ev, Started) else ev

    def _argv(self, conv: Conversation) -> list[str]:
        argv = [self.cli, "exec"]
        if conv.session_id:
            argv.append("resume")
        argv += ["--json", "--skip-git-repo-check"]
        if self.sandbox == "danger-full-access":
            argv.append("--dangerously-bypass-approvals-and-sandbox")  # else config.toml's sandbox_mode holds
        argv += self.settings.args
        if conv.session_id:
            argv.append(conv.session_id)
        return [*argv, "-"]  # the prompt comes on stdin: any length, even one starting with "-"

    async def _run(self, conv: Conversation, prompt: str) -> AsyncIterator[Event]:
        proc = await Proc.spawn(self._argv(conv), cwd=conv.cwd, env={**self.env, **conv.env}, stdin=True)
        error: dict[str, Any] | None = None
        total: Usage | None = None
        started: set[Any] = set()  # items whose ToolStarted went out already
        try:
            await proc.write(prompt.encode(), close=True)
            async for line in _lines(proc):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind = event.get("type")
                if kind == "thread.started" and not conv.session_id:
                    conv.session_id = str(event["thread_id"])
                    yield Started(conv.session_id)
                elif kind == "error":
                    message = str(event.get("message", ""))
                    if message.startswith("Reconnecting"):
                        yield Notice("retry", message)
                    else:
                        error = error or {"message": message}
                elif kind == "turn.failed":
                    error = event.get("error") or {"message": "codex reported a failed turn"}
                elif kind == "turn.completed":
                    total = _usage(event.get("usage") or {}, snake=True)
                elif kind in ("item.started", "item.completed"):
                    item = event.get("item") or {}
                    for ev in _item_events(item, done=kind == "item.completed", already=item.get("id") in started):
                        yield ev
                    started.add(item.get("id"))
            code = await proc.wait()
        except BaseException:
            await proc.stop()
            raise
        if error is not None:
            raise provider_error(error, conv.session_id, exit_code=code, stderr=proc.stderr_tail())
        if code != 0 or total is None:
            raise BackendCrashed("codex exec exited without finishing its turn", backend=self.name, exit_code=code,
                                 stderr_tail=proc.stderr_tail(), session_id=conv.session_id)
        # `codex exec` reports the thread's running total: this turn's share is the growth (a
        # failed turn reports none, so what it spent shows up in the next turn that completes)
        before = conv.state.get("codex_total") or Usage()
        conv.state["codex_total"] = total
        yield StepUsage(Usage(total.input_tokens - before.input_tokens, total.output_tokens - before.output_tokens,
                              total.cached_tokens - before.cached_tokens))

    def log(self, conv: Conversation) -> Path | None:
        """`$CODEX_HOME/sessions/YYYY/MM/DD/rollout-<time>-<thread id>.jsonl`, once codex wrote it."""
        if conv.session_id is None:
            return None
        return next((self.home / "sessions").glob(f"*/*/*/rollout-*-{conv.session_id}.jsonl"), None)

    async def end(self, conv: Conversation) -> None:
        if self.transport == "server" and conv.session_id:
            await self.server.forget(conv.session_id)

    async def aclose(self) -> None:
        await self.server.close()


def native(cli: str) -> tuple[str, dict[str, str]]:
    """The npm package's platform binary behind its `codex.js` launcher, and what the launcher
    sets for it. On Node < 22.15 the launcher runs the binary as a child instead of exec'ing it,
    and a child of a child does not die with shoal (PR_SET_PDEATHSIG reaches one generation);
    it also saves a Node start per turn. Anything else (a binary, an override) is run as given."""
    launcher = Path(cli).resolve()
    if launcher.name != "codex.js" or launcher.parent.name != "bin":
        return cli, {}
    package = launcher.parent.parent
    triple = {("x86_64", "Linux"): "x86_64-unknown-linux-musl", ("aarch64", "Linux"): "aarch64-unknown-linux-musl"}
    target = triple.get((os.uname().machine, os.uname().sysname))
    if target is None:
        return cli, {}
    arch = "x64" if target.startswith("x86_64") else "arm64"
    for vendor in (package.parent / f"codex-linux-{arch}" / "vendor", package / "vendor"):
        binary = vendor / target / "bin" / "codex"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary), {"CODEX_MANAGED_PACKAGE_ROOT": str(package), "CODEX_MANAGED_BY_NPM": "1"}
    return cli, {}


class ServerTurn:
    """One app-server turn: its notifications in, shoal events out, one StepUsage at the end."""

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.done = False
        self._started: set[str] = set()
        self._base: Usage | None = None  # the thread's total before this turn's first model call
        self._total = Usage()
        self._error: dict[str, Any] | None = None

    def feed(self, msg: dict[str, Any], session_id: str | None) -> list[Event]:
        method, params = msg.get("method"), msg.get("params") or {}
        turn = params.get("turn") or {}
        if params.get("turnId", turn.get("id", self.turn_id)) != self.turn_id:
            return []  # a late notification of an earlier (interrupted) turn
        if method in ("item/started", "item/completed"):
            item = _camel_item(params.get("item") or {})
            done = method == "item/completed"
            events = _item_events(item, done=done, already=item.get("id") in self._started)
            self._started.add(str(item.get("id")))
            return events
        if method == "thread/tokenUsage/updated":
            usage = params.get("tokenUsage") or {}
            total, last = _usage(usage.get("total") or {}), _usage(usage.get("last") or {})
            if self._base is None:
                self._base = Usage(total.input_tokens - last.input_tokens, total.output_tokens - last.output_tokens,
                                   total.cached_tokens - last.cached_tokens)
            self._total = total
            return []
        if method == "error":
            err = params.get("error") or {}
            if params.get("willRetry"):
                return [Notice("retry", f"{err.get('message')}: {err.get('additionalDetails') or ''}".strip(": "))]
            self._error = err
            return []
        if method != "turn/completed":
            return []
        self.done = True
        base = self._base or self._total
        used = Usage(self._total.input_tokens - base.input_tokens, self._total.output_tokens - base.output_tokens,
                     self._total.cached_tokens - base.cached_tokens)
        status = turn.get("status")
        if status == "completed":
            return [StepUsage(used)]
        if status == "interrupted":
            raise TurnFailed("codex turn was interrupted", backend="codex", session_id=session_id)
        raise provider_error(turn.get("error") or self._error or {"message": f"codex turn ended {status}"},
                             session_id)


def _camel_item(item: dict[str, Any]) -> dict[str, Any]:
    """An app-server item in `codex exec`'s spelling, so one mapping serves both transports."""
    kind = {"commandExecution": "command_execution", "fileChange": "file_change", "agentMessage": "agent_message",
            "mcpToolCall": "mcp_tool_call", "webSearch": "web_search"}.get(str(item.get("type")), item.get("type"))
    changes = [{"path": c.get("path"), "kind": _kind(c.get("kind"))} for c in item.get("changes") or []]
    return {**item, "type": kind, "aggregated_output": item.get("aggregatedOutput"),
            "exit_code": item.get("exitCode"), "changes": changes}


def _kind(kind: Any) -> str:
    return str(kind.get("type") if isinstance(kind, dict) else kind)  # {"type": "add"} on the server


def _item_events(item: dict[str, Any], *, done: bool, already: bool = False) -> list[Event]:
    """ToolStarted / ToolFinished / Text for one codex item (exec spelling), started or completed."""
    kind, call_id, status = item.get("type"), str(item.get("id", "")), item.get("status")
    args: dict[str, Any]
    if kind == "agent_message":
        return [Text(str(item["text"]))] if done and item.get("text") else []
    if kind == "command_execution":
        tool, args = "shell", {"command": _unwrap(str(item.get("command", "")))}
        code = item.get("exit_code")
        ok = code == 0 if code is not None else status == "completed"
        finished = ToolFinished(call_id, tool, args, str(item.get("aggregated_output") or ""), code, ok)
    elif kind == "file_change":
        changes = [{"path": str(c.get("path")), "kind": str(c.get("kind"))} for c in item.get("changes") or []]
        tool, args = "apply_patch", {"changes": changes}
        summary = "\n".join(f"{c['kind']} {c['path']}" for c in changes)
        finished = ToolFinished(call_id, tool, args, summary, None, status == "completed")
    elif kind == "mcp_tool_call":
        tool, args = f"{item.get('server')}.{item.get('tool')}", dict(item.get("arguments") or {})
        output = json.dumps(item.get("result") or item.get("error"))
        finished = ToolFinished(call_id, tool, args, output, None, status == "completed")
    elif kind == "web_search":
        tool, args = "web_search", {"query": str(item.get("query", ""))}
        finished = ToolFinished(call_id, tool, args, "", None, True)
    elif kind == "error" and done:
        return [Notice("warning", str(item.get("message", "")))]
    else:
        return []
    started = ToolStarted(call_id, tool, args)
    if not done:
        return [started]
    return [finished] if already else [started, finished]


def _unwrap(command: str) -> str:
    """`/bin/bash -lc 'cat a.txt'` -> `cat a.txt`: the command as the model wrote it."""
    try:
        parts = shlex.split(command)
    except ValueError:
        return command
    if len(parts) == 3 and parts[0].rsplit("/", 1)[-1] in ("bash", "sh", "zsh") and parts[1] in ("-lc", "-c"):
        return parts[2]
    return command


def _usage(u: dict[str, Any], *, snake: bool = False) -> Usage:
    keys = ("input_tokens", "output_tokens", "cached_input_tokens") if snake else (
        "inputTokens", "outputTokens", "cachedInputTokens")
    return Usage(*(int(u.get(k) or 0) for k in keys))


def provider_error(err: dict[str, Any], session_id: str | None, *, exit_code: int | None = None,
                   stderr: str = "") -> TurnFailed:
    """A codex error (TurnError / exec `turn.failed`) as ProviderError when a provider said no."""
    message = str(err.get("message") or "codex reported an error")
    hay = f"{message} {err.get('additionalDetails') or ''}"
    info = err.get("codexErrorInfo")
    status: int | None = None
    if isinstance(info, dict):  # {"httpConnectionFailed": {"httpStatusCode": 401}} and its kin
        for detail in info.values():
            if isinstance(detail, dict) and detail.get("httpStatusCode"):
                status = int(detail["httpStatusCode"])
    elif isinstance(info, str):
        status = STATUS_OF.get(info)
    if status is None and (m := HTTP_STATUS.search(hay)):
        status = int(m.group(1))
    from_provider = (status is not None or isinstance(info, dict)
                     or (isinstance(info, str) and info not in NOT_PROVIDER) or bool(PROVIDER_MESSAGE.search(hay)))
    rid = m.group(1) if (m := REQUEST_ID.search(hay)) else None
    common: dict[str, Any] = {"backend": "codex", "exit_code": exit_code, "stderr_tail": stderr,
                              "request_id": rid, "session_id": session_id}
    if from_provider:
        hint = {401: " (check the provider's API key)", 429: " (rate limited; retry later)"}.get(status or 0, "")
        return ProviderError(f"provider error {status or ''}: {message}{hint}".replace(" :", ":"), status=status,
                             **common)
    return TurnFailed(f"codex: {message}", **common)


async def _lines(proc: Proc) -> AsyncIterator[bytes]:
    while line := await proc.readline():
        yield line
