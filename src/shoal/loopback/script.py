"""The loopback model's brain: read a conversation, decide the next move.

Every wire format is first flattened into a `Conversation` (user texts, tool results, the
working directory the CLI announced, the tools it offered). The script lives in the latest
user message as `#!` directives; which step we are on is simply how many tool results came
back after that message, so the model itself keeps no state between requests and a resumed
conversation on a fresh CLI process behaves exactly like a held-open one.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

DIRECTIVE = re.compile(r"^\s*#!\s*(\w+)\s?(.*)$")
REMEMBER = re.compile(r"remember:\s*(\S+)")
# Where each CLI announces its working directory in what it sends.
CWD_PATTERNS = (
    re.compile(r"Primary working directory:\s*(\S+)"),  # claude
    re.compile(r"<cwd>([^<]+)</cwd>"),  # codex
    re.compile(r"Working directory:\s*(\S+)"),  # opencode
)
TOOL_DIRECTIVES = {"write", "run"}
KNOWN = TOOL_DIRECTIVES | {"say", "recall", "fail", "sleep"}


@dataclass
class Conversation:
    """What a request says, whatever format it came in."""

    user_texts: list[str] = field(default_factory=list)
    # tool results seen after the latest user text (the step counter)
    results_after_last_user: int = 0
    system_text: str = ""
    tools: list[str] = field(default_factory=list)

    def add_user(self, text: str) -> None:
        if _injected(text):
            # context a CLI adds on its own (environment, AGENTS.md): not the user speaking
            self.system_text += text + "\n"
            return
        self.user_texts.append(text)
        self.results_after_last_user = 0

    def add_result(self) -> None:
        self.results_after_last_user += 1

    @property
    def prompt(self) -> str:
        return self.user_texts[-1] if self.user_texts else ""

    @property
    def cwd(self) -> str | None:
        hay = self.system_text + "\n" + "\n".join(self.user_texts)
        for pat in CWD_PATTERNS:
            m = pat.search(hay)
            if m:
                return m.group(1).strip()
        return None


def _injected(text: str) -> bool:
    head = text.lstrip()
    return head.startswith("<environment_context") or head.startswith("# AGENTS.md") or (
        head.startswith("<") and "#!" not in text
    )


@dataclass(frozen=True)
class Directive:
    verb: str
    arg: str


@dataclass(frozen=True)
class ToolMove:
    """Call a tool: `kind` is 'write' or 'run'."""

    kind: str
    path: str = ""
    text: str = ""
    command: str = ""


@dataclass(frozen=True)
class FinalMove:
    text: str


@dataclass(frozen=True)
class FailMove:
    status: str  # "429", "500", "401" or "drop"
    times: int | None  # fail only the first N attempts; None = always


@dataclass
class Plan:
    sleep: float
    move: ToolMove | FinalMove | FailMove
    step: int


def parse(prompt: str) -> list[Directive]:
    out: list[Directive] = []
    for line in prompt.splitlines():
        m = DIRECTIVE.match(line)
        if m and m.group(1).lower() in KNOWN:
            out.append(Directive(m.group(1).lower(), m.group(2).strip()))
    return out


def unescape(text: str) -> str:
    return text.replace("\\n", "\n").replace("\\t", "\t")


def plan(conv: Conversation, *, skip_fails: bool = False) -> Plan:
    """The next move for this request: sleep first, then one tool call, a failure or the answer.

    `skip_fails` plans as if this step's `#! fail` were not there (its failures are spent)."""
    directives = parse(conv.prompt)
    step = conv.results_after_last_user
    seen_tools = 0
    sleep = 0.0
    says: list[str] = []
    for d in directives:
        if d.verb in TOOL_DIRECTIVES:
            if seen_tools == step:
                return Plan(sleep, _tool(d), step)
            seen_tools += 1
            sleep = 0.0  # sleeps before an earlier tool call belonged to an earlier request
            continue
        if d.verb == "say":
            says.append(unescape(d.arg))
        elif d.verb == "recall":
            says.append(recall(conv))
        if seen_tools != step:
            continue
        if d.verb == "sleep":
            sleep += float(d.arg or 0)
        elif d.verb == "fail" and not skip_fails:
            parts = d.arg.split()
            status = parts[0] if parts else "500"
            times = int(parts[1]) if len(parts) > 1 else None
            return Plan(sleep, FailMove(status, times), step)
    text = "\n".join(s for s in says if s) or "ok"
    return Plan(sleep, FinalMove(text), step)


def recall(conv: Conversation) -> str:
    words: list[str] = []
    for text in conv.user_texts:
        for w in REMEMBER.findall(text):
            if w not in words:
                words.append(w)
    return "recalled: " + (" ".join(words) if words else "(nothing)")


def _tool(d: Directive) -> ToolMove:
    if d.verb == "write":
        path, _, text = d.arg.partition(" ")
        return ToolMove("write", path=path, text=unescape(text))
    return ToolMove("run", command=d.arg)


def absolute(path: str, cwd: str | None) -> str:
    if path.startswith("/") or not cwd:
        return path
    return cwd.rstrip("/") + "/" + path


def shell_write(path: str, text: str) -> str:
    """The shell fallback for a write, for CLIs that offer no write tool."""
    q = shlex.quote(path)
    return f"mkdir -p \"$(dirname {q})\" && printf '%s\\n' {shlex.quote(text)} > {q}"
