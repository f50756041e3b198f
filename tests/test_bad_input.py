"""Bad input is a named ShoalError, said before anything starts, and loses nothing.

Each case here was once a raw TypeError/AttributeError/KeyError, a traceback from the CLI,
a silent misreading (a str batch run letter by letter, a misspelt `keep=` deleting work),
or an exit code 0 for a run that did nothing. Almost none of them needs a turn.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shoal
from shoal.cli.main import main as cli


@pytest.fixture(scope="module")
def agent() -> Iterator[shoal.Agent]:
    with shoal.Agent("opencode", model="loopback") as a:
        yield a


@pytest.fixture()
def a_file(tmp_path: Path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("not a directory")
    return f


# --- the agent's settings -----------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "says"), [
    ({"model": None}, shoal.BadModel, "model must be a string"),
    ({"permissions": ["bash"]}, shoal.BadArgument, "permissions must be a dict"),
    ({"env": "A=B"}, shoal.BadArgument, "env must be a dict"),
    ({"env": {"A": 1}}, shoal.BadArgument, "env must be a dict of str -> str"),
    ({"args": "--verbose"}, shoal.BadArgument, "args must be a list of strings"),
    ({"args": [1]}, shoal.BadArgument, "args must be a list of strings"),
    ({"turn_timeout": "10"}, shoal.BadArgument, "turn_timeout"),
    ({"turn_timeout": 0}, shoal.BadSetting, "more than 0"),
    ({"turn_timeout": -1}, shoal.BadSetting, "more than 0"),
    ({"hosts": "auto"}, shoal.BadArgument, "shoal.Ray"),
])
def test_agent_settings_of_the_wrong_kind_are_named(kwargs: dict[str, Any], error: type[Exception],
                                                    says: str) -> None:
    with pytest.raises(error, match=says):
        shoal.Agent("opencode", **kwargs)


def test_wrong_types_stay_catchable_as_the_builtins_they_replace() -> None:
    with pytest.raises(TypeError):
        shoal.Agent("opencode", args="--verbose")
    with pytest.raises(ValueError):
        shoal.Agent("opencode", turn_timeout=-1)


@pytest.mark.parametrize("backend", ["opencode", "claude", "codex"])
def test_a_misspelt_permission_is_refused_by_every_backend(backend: str) -> None:
    # claude and codex took {"bash": "Deny"} silently: the shell stayed allowed
    with pytest.raises(shoal.BadSetting, match=r"'Deny' is not allow, deny or ask"):
        shoal.Agent(backend, permissions={"bash": "Deny"})


def test_codex_sandbox_must_be_one_it_has() -> None:
    with pytest.raises(shoal.BadSetting, match=r"not a codex sandbox"):
        shoal.Agent("codex", permissions={"sandbox": "read_only"})
    shoal.Agent("codex", permissions={"sandbox": "read-only"}).close()


def test_home_that_is_a_file(a_file: Path) -> None:
    with pytest.raises(shoal.BadSetting, match=r"not a directory"):
        shoal.Agent("opencode", home=a_file)


# --- sessions and turns -------------------------------------------------------------------------


def test_where_that_is_not_a_place(agent: shoal.Agent) -> None:
    with pytest.raises(shoal.BadArgument, match=r"where= must be a directory"):
        agent.session(where=3)  # type: ignore[arg-type]


def test_a_turn_that_could_only_fail_is_not_sent(agent: shoal.Agent, tmp_path: Path) -> None:
    s = agent.session(where=tmp_path)
    with pytest.raises(shoal.BadArgument, match=r"a prompt is a str"):
        s.run(None)  # type: ignore[arg-type]
    with pytest.raises(shoal.BadSetting, match=r"prompt is empty"):
        s.run("   ")
    with pytest.raises(shoal.BadSetting, match=r"timeout .* more than 0"):
        s.run("#! say hi", timeout=-1)
    with pytest.raises(shoal.BadSetting, match=r"prompt is empty"):
        s.stream("")
    assert not s.started  # nothing was made for them


# --- places ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda d: shoal.Copy(d, keep="change"),  # type: ignore[arg-type]
    lambda d: shoal.Worktree(d, task="t", keep="sometimes"),  # type: ignore[arg-type]
])
def test_a_misspelt_keep_never_decides_to_delete_work(make: Any, tmp_path: Path) -> None:
    # Copy(keep="change") used to delete a copy holding changes when it was given back
    with pytest.raises(shoal.BadSetting, match=r"is not one of 'changed', 'always', 'never'"):
        make(tmp_path)


def test_copy_under_a_root_that_is_a_file(agent: shoal.Agent, tmp_path: Path, a_file: Path) -> None:
    with pytest.raises(shoal.PlaceError, match=r"not a directory; pass another root="):
        agent.session(where=shoal.Copy(tmp_path, root=a_file))


@pytest.mark.parametrize(("make", "error", "says"), [
    (lambda: shoal.Copy(None), shoal.BadArgument, "Copy's source"),  # type: ignore[arg-type]
    (lambda: shoal.Worktree(".", task=3), shoal.BadArgument, "task must be a string"),  # type: ignore[arg-type]
    (lambda: shoal.Container(""), shoal.BadArgument, "needs an image name"),
    (lambda: shoal.Container("debian:12", options="--memory 2g"), shoal.BadArgument,  # type: ignore[arg-type]
     "options must be a list of strings"),
    (lambda: shoal.SSH("me@:/srv"), shoal.PlaceError, "not of the form"),
    (lambda: shoal.SSH("me@box:/srv", port="22"), shoal.BadArgument, "port"),  # type: ignore[arg-type]
    (lambda: shoal.SSH("me@box:/srv", port=70000), shoal.BadSetting, "1-65535"),
    (lambda: shoal.SSH("me@box:/srv", options="-v"), shoal.BadArgument, "options"),  # type: ignore[arg-type]
    (lambda: shoal.SSH("me@box:/srv", connect_timeout=0), shoal.BadSetting, "connect_timeout"),
])
def test_places_with_bad_arguments(make: Any, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        make()


# --- flows ----------------------------------------------------------------------------------------


async def _echo(task: str) -> str:
    return task


@pytest.mark.parametrize(("make", "error"), [
    (lambda: shoal.Budget(cost=-1), shoal.BadSetting),
    (lambda: shoal.Budget(seconds=0), shoal.BadSetting),
    (lambda: shoal.Budget(tokens="5"), shoal.BadArgument),  # type: ignore[arg-type]
    (lambda: shoal.flow(_echo).options(timeout=0), shoal.BadSetting),
    (lambda: shoal.flow(_echo).options(timeout="5"), shoal.BadArgument),  # type: ignore[arg-type]
    (lambda: shoal.flow(_echo).options(budget=2.0), shoal.BadArgument),  # type: ignore[arg-type]
])
def test_budgets_and_deadlines_that_cannot_be_met(make: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        make()


def test_run_of_something_that_is_no_flow() -> None:
    with pytest.raises(shoal.FlowError, match=r"shoal.run takes a flow"):
        shoal.run(3)  # type: ignore[arg-type]
    with pytest.raises(shoal.FlowError, match=r"a flow reference is"):
        shoal.load("")
    assert shoal.run(_echo, "plain async def") == "plain async def"


def test_set_price_takes_a_price() -> None:
    with pytest.raises(shoal.BadArgument, match=r"shoal.Price"):
        shoal.set_price("m", 3.0)  # type: ignore[arg-type]


# --- batches --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompts", "kwargs", "error", "says"), [
    ("#! say hi", {}, shoal.BadArgument, r"wrap a single prompt in a list"),  # was: one unit per letter
    ([{"task": "a"}], {}, shoal.BadSetting, "has no 'prompt'"),
    ([("a",)], {}, shoal.BadArgument, "is not a prompt"),
    ([3], {}, shoal.BadArgument, "is not a prompt"),
    ([{"prompt": None}], {}, shoal.BadSetting, "not a prompt"),
    (["#! say hi"], {"limit": "3"}, shoal.BadArgument, "limit"),
    (["#! say hi"], {"retries": -1}, shoal.BadSetting, "retries must be at least 0"),
    (["#! say hi"], {"retries": "2"}, shoal.BadArgument, "retries"),
    (["#! say hi"], {"cost_cap": -1}, shoal.BadSetting, "cost_cap"),
    (["#! say hi"], {"cost_cap": "5"}, shoal.BadArgument, "cost_cap"),
    (["#! say hi"], {"chekc": "true"}, shoal.BadArgument, "unknown batch guardrail.*'chekc'"),
    (["#! say hi"], {"check": ["true"]}, shoal.BadArgument, "check must be a shell command"),
    (["#! say hi"], {"check": "true", "check_timeout": 0}, shoal.BadSetting, "check_timeout"),
    (["#! say hi"], {"on_update": 3}, shoal.BadArgument, "on_update must be callable"),
    (["#! say hi"], {"retry_prompt": "{nope}"}, shoal.BadSetting, "retry_prompt"),
    (["#! say hi"], {"where": 3}, shoal.BadArgument, "where="),
])
def test_batch_input_is_refused_before_any_unit_starts(agent: shoal.Agent, prompts: Any, kwargs: dict[str, Any],
                                                       error: type[Exception], says: str) -> None:
    before = len(agent.sessions)
    with pytest.raises(error, match=says):
        agent.batch(prompts, **kwargs)
    assert len(agent.sessions) == before  # not one session was opened


def test_a_check_past_its_timeout_fails_its_unit_not_the_batch(agent: shoal.Agent, tmp_path: Path) -> None:
    # it used to raise a bare TimeoutError out of the whole batch
    out = agent.batch(["#! say hi"], tmp_path, check="sleep 30", check_timeout=0.5, suppress=True)
    assert isinstance(out[0], shoal.CheckFailed)
    assert out[0].check.exit_code is None  # type: ignore[attr-defined]
    assert "check_timeout" in out[0].check.output  # type: ignore[attr-defined]


# --- the command line -----------------------------------------------------------------------------


def _quit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `shoal ARGV`, which must refuse: the one line it says (never a traceback)."""
    try:
        code = cli(argv)
    except SystemExit as exc:
        assert exc.code not in (0, None), argv
        return str(exc.code)
    assert code == 2, argv
    return capsys.readouterr().err


def test_cli_batch_bad_prompts_and_places(tmp_path: Path, a_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nulls = tmp_path / "p.jsonl"
    nulls.write_text('{"prompt": null}\n')  # was sent as the prompt "None"
    assert "its prompt is None" in _quit(["batch", str(nulls)], capsys)
    good = tmp_path / "ok.txt"
    good.write_text("#! say hi\n")
    assert "is not a directory" in _quit(["batch", str(good), "--here", str(a_file)], capsys)
    assert "retries must be at least 0" in _quit(["batch", str(good), "--retries", "-1"], capsys)


def test_cli_numbers_that_run_nothing_are_refused(tmp_path: Path, a_file: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert "-n must be at least 1" in _quit(["demo", "-n", "0"], capsys)  # was "0/0 correct", exit 0
    assert "--max-n and --reps" in _quit(["bench", "--max-n", "0"], capsys)
    assert "names no backend" in _quit(["bench", "--backends", ","], capsys)
    assert "cannot write results" in _quit(["bench", "--out", str(a_file), "--backends", "opencode"], capsys)


def test_cli_ports_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert "Address already in use" in _quit(["loopback", "--port", port], capsys)
        assert "Address already in use" in _quit(["opencode", "serve", "--port", port, "--dir", str(tmp_path)],
                                                 capsys)
    assert "0-65535" in _quit(["loopback", "--port", "70000"], capsys)
    assert "cannot write --log" in _quit(["loopback", "--log", str(tmp_path / "no" / "log.jsonl")], capsys)


def test_cli_opencode_serve_dir_that_is_not_one(a_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "is not a directory" in _quit(["opencode", "serve", "--dir", str(a_file)], capsys)


def test_perfetto_to_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    from shoal import perfetto
    from shoal.journal import read

    shoal.run(shoal.flow(_echo).options(runs=tmp_path / "runs"), "x")
    run = read(str(next((tmp_path / "runs").iterdir())))
    with pytest.raises(shoal.CannotWrite, match=r"cannot write the perfetto trace"):
        perfetto.export(run, tmp_path / "no" / "such" / "out.json")
