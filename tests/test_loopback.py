"""The loopback model on its own: wire formats over real HTTP, the script, the request log."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from shoal.loopback import INPUT_TOKENS, LoopbackModel
from shoal.loopback.script import Conversation, FailMove, FinalMove, ToolMove, plan


def post(model: LoopbackModel, path: str, body: dict) -> tuple[int, str]:  # type: ignore[type-arg]
    req = urllib.request.Request(model.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def conv(prompt: str, results: int = 0, earlier: tuple[str, ...] = ()) -> Conversation:
    c = Conversation(system_text="Working directory: /w")
    for text in (*earlier, prompt):
        c.add_user(text)
    for _ in range(results):
        c.add_result()
    return c


def test_script_steps_one_tool_per_request() -> None:
    prompt = "#! write a.txt hi\n#! sleep 0.5\n#! run ls\n#! say done"
    first, second, third = (plan(conv(prompt, n)) for n in range(3))
    assert first.move == ToolMove("write", path="a.txt", text="hi") and first.sleep == 0
    assert second.move == ToolMove("run", command="ls") and second.sleep == 0.5
    assert third.move == FinalMove("done")


def test_recall_lists_remembered_words_from_earlier_turns() -> None:
    p = plan(conv("#! recall", earlier=("remember: alpha", "x remember: beta")))
    assert p.move == FinalMove("recalled: alpha beta")


def test_fail_directive() -> None:
    assert plan(conv("#! fail 429 2")).move == FailMove("429", 2)
    assert plan(conv("#! fail drop")).move == FailMove("drop", None)


def test_no_directives_answers_ok_and_injected_context_is_not_the_prompt() -> None:
    c = conv("hello")
    c.add_user("<environment_context><cwd>/elsewhere</cwd></environment_context>")
    assert plan(c).move == FinalMove("ok")
    assert c.prompt == "hello"


@pytest.fixture(scope="module")
def model() -> LoopbackModel:
    with LoopbackModel() as m:
        yield m  # type: ignore[misc]


def test_chat_completions_stream_a_tool_call(model: LoopbackModel) -> None:
    body = {"model": "loopback", "stream": True,
            "messages": [{"role": "system", "content": "Working directory: /w"},
                         {"role": "user", "content": "#! write a.txt hi"}],
            "tools": [{"type": "function", "function": {"name": "write", "parameters": {}}}]}
    status, text = post(model, "/v1/chat/completions", body)
    assert status == 200
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    call = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls"))
    fn = call["choices"][0]["delta"]["tool_calls"][0]["function"]
    assert fn["name"] == "write" and json.loads(fn["arguments"]) == {"filePath": "/w/a.txt", "content": "hi\n"}
    assert chunks[-1]["usage"]["prompt_tokens"] == INPUT_TOKENS
    assert text.rstrip().endswith("data: [DONE]")


def test_responses_and_messages_answer_text(model: LoopbackModel) -> None:
    status, text = post(model, "/v1/responses", {"model": "m", "input": "#! say yo", "stream": False})
    assert status == 200 and json.loads(text)["output"][0]["content"][0]["text"] == "yo"
    status, text = post(model, "/v1/messages", {"model": "m", "stream": True,
                                                "messages": [{"role": "user", "content": "#! say hey"}]})
    assert status == 200 and '"text_delta", "text": "hey"' in text and "message_stop" in text


def test_scripted_errors_and_request_log(model: LoopbackModel) -> None:
    status, text = post(model, "/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "#! fail 429"}]})
    assert status == 429 and json.loads(text)["error"]["type"] == "rate_limit_error"
    status, _ = post(model, "/v1/chat/completions", {"messages": [{"role": "user", "content": "#! fail 500 1"}]})
    assert status == 500
    status, text = post(model, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "#! fail 500 1\n#! say after"}]})
    assert status == 500
    status, text = post(model, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "#! fail 500 1\n#! say after"}]})
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "after"  # spent: goes on
    assert [r.move for r in model.requests[-4:]] == ["fail:429", "fail:500", "fail:500", "fail:500"]
    with urllib.request.urlopen(model.url + "/v1/models", timeout=5) as resp:
        assert json.load(resp)["data"][0]["id"] == "loopback"
