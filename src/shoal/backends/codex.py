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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shoal.backends.base import Conversation, Settings, base_env, find_cli
from shoal.backends.codex_appserver import NO_ROLLOUT, ServerTransport
from shoal.backends.codex_events import ServerTurn, item_events, provider_error, usage_of
from shoal.errors import BackendCrashed, BadModel, BadSetting, ProtocolMismatch
from shoal.procs import Proc
from shoal.reply import Event, Notice, Started, StepUsage, Usage

PINNED = "0.171.0"  # package.json pins @openai/codex; the app-server protocol changes between minors
LOOPBACK_SLUG = "gpt-5.5"
PROVIDER = "shoal"  # the model_providers entry for the loopback (or an OpenAI API key)
KEY_VAR = "SHOAL_CODEX_API_KEY"
# Codex retries a failed model request with backoff, 5 times by default (~6.5 s for a
# scripted 401). Against the loopback two retries keep `#! fail 500 2` recoverable and make
# a permanent failure cost under a second. Real providers keep codex's defaults.
LOOPBACK_RETRIES = 2
SANDBOXES = ("read-only", "workspace-write", "danger-full-access")


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
    if explicit is not None:
        raise BadSetting(f"permission 'sandbox': {explicit!r} is not a codex sandbox; one of {', '.join(SANDBOXES)}")
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
                    total = usage_of(event.get("usage") or {}, snake=True)
                elif kind in ("item.started", "item.completed"):
                    item = event.get("item") or {}
                    for ev in item_events(item, done=kind == "item.completed", already=item.get("id") in started):
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


async def _lines(proc: Proc) -> AsyncIterator[bytes]:
    while line := await proc.readline():
        yield line
