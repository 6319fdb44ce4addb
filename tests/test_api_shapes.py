"""How the Responses and Messages requests read into chat requests (no server: the shapes'
own translation), where a live test would not tell the cases apart."""

from __future__ import annotations

import pytest

from pagoda.server.errors import APIError
from pagoda.server.messages_api import to_chat
from pagoda.server.responses_api import ResponsesShape, ResponseStore, input_messages


def test_an_assistant_prefill_is_continued_not_answered():
    chat = to_chat({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]})
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    chat = to_chat({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Name a color."}]})
    assert "continue_final_message" not in chat


def test_tool_use_and_tool_result_blocks_become_a_call_and_its_answer():
    chat = to_chat({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]}]})
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}


def test_function_calls_join_the_assistant_message_before_them():
    messages = input_messages([
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"] and messages[1]["content"] == "Checking."


def test_a_turn_on_a_response_that_has_not_ended_is_refused():
    store = ResponseStore(4)
    running = ResponsesShape(store)
    running.body = {"input": "hi"}
    store.put(running._response("in_progress"), [{"role": "user", "content": "hi"}], [])
    with pytest.raises(APIError, match="is in_progress") as refused:
        ResponsesShape(store).to_chat({"input": "next", "previous_response_id": running.id})
    assert refused.value.param == "previous_response_id"
    with pytest.raises(APIError, match="needs 'store'"):
        ResponsesShape(ResponseStore(0)).to_chat({"input": "x", "background": True})
