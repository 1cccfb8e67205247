"""Tool-call parsers on recorded outputs of each family's format: the whole-text extraction gives
vLLM's calls and content, and a stream cut anywhere (one character per delta, and every split in
two) adds up to the same: content fragments to the whole content, each call's name once with an
id, its argument fragments to the whole arguments string."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from pagedjax.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedjax.entrypoints.openai.tool_parsers.json_scan import JsonValueScan
from pagedjax.entrypoints.openai.tool_parsers.required_tool_parser import (
    NamedToolCallParser,
    RequiredToolCallParser,
)


class Request(BaseModel):
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    skip_special_tokens: bool | None = None


REQUEST = Request(tools=[{"type": "function", "function": {"name": "get_weather"}}])


def parser_factory(name: str) -> Callable[[], ToolParser]:
    if name == "required":
        return RequiredToolCallParser
    if name.startswith("named:"):
        return lambda: NamedToolCallParser(name.removeprefix("named:"))
    return lambda: ToolParserManager.get_tool_parser(name)(None)


# (parser, model output, expected): expected is (content, [(name, arguments object), ...]),
# or None where no tool is called (the content is then the whole output).
CASES: list[tuple[str, str, tuple[str | None, list[tuple[str, Any]]] | None]] = [
    # Hermes-2-Pro / Qwen2.5: one call, as the chat template asks for it
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
               '"San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>',
     (None, [("get_current_temperature",
              {"location": "San Francisco, CA, USA", "unit": "celsius"})])),
    # two calls, and content before the first
    ("hermes", "I'll look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
               "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
               "\"arguments\": {\"timezone\": \"Europe/Paris\"}}\n</tool_call>",
     ("I'll look both up.\n", [("get_weather", {"city": "Paris"}),
                               ("get_time", {"timezone": "Europe/Paris"})])),
    # only whitespace before the call: content None
    ("hermes", '\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     (None, [("get_time", {})])),
    # strings with braces, quotes, escapes, unicode; nested lists and objects
    ("hermes", '<tool_call>\n{"name": "run_code", "arguments": {"code": "def f():\\n    '
               'return {\\"a\\": [1, 2]}\\n", "note": "naïve café ☕ 日本", "path": '
               '"C:\\\\tmp\\\\x", "re": "^\\\\d{3}$", "deep": {"l": [[1], {"m": null}], '
               '"b": true}}}\n</tool_call>',
     (None, [("run_code", {"code": 'def f():\n    return {"a": [1, 2]}\n',
                           "note": "naïve café ☕ 日本", "path": "C:\\tmp\\x",
                           "re": "^\\d{3}$", "deep": {"l": [[1], {"m": None}], "b": True}})])),
    # the model stopped before </tool_call>
    ("hermes", 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
     ("Checking.", [("get_weather", {"city": "Oslo"})])),
    # "arguments" before "name"; a call without arguments; text between and after is dropped
    ("hermes", '<tool_call>\n{"arguments": {"query": "vllm"}, "name": "search"}\n</tool_call>\n'
               'and then\n<tool_call>\n{"name": "get_time"}\n</tool_call>\nDone.',
     (None, [("search", {"query": "vllm"}), ("get_time", {})])),
    # a "</tool_call>" inside a string does not end the block
    ("hermes", '<tool_call>\n{"name": "echo", "arguments": {"text": "a </tool_call> b"}}\n'
               '</tool_call>',
     (None, [("echo", {"text": "a </tool_call> b"})])),
    # a repeated key: the first value counts (a stream cannot take back what it sent of it)
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}, '
               '"name": "g"}\n</tool_call>', (None, [("f", {"a": 1})])),
    ("hermes", "The capital of France is Paris.", None),
    ("hermes", "Wrap it in a <tool> tag, or <tool_calls>.", None),
    # invalid JSON in the block, seen before the name: all content
    ("hermes", '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>', None),
    ("hermes", "Sure.\n<tool_call>\nnot json at all\n</tool_call>", None),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', None),  # no name
    # Llama 3.1 / 3.2 JSON: "parameters", the <|python_tag|>, several calls separated by ";"
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}',
     (None, [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    ("llama3_json", '<|python_tag|>{"name": "search", "arguments": {"query": "latest news"}}',
     (None, [("search", {"query": "latest news"})])),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": '
                    '{"y": [1, {"z": "s;t}"}]}};{"name": "c", "parameters": {}}',
     (None, [("a", {"x": 1}), ("b", {"y": [1, {"z": "s;t}"}]}), ("c", {})])),
    ("llama3_json", '\n\n{"name": "create_event", "parameters": {"event": {"title": '
                    '"Team {sync}", "attendees": [{"name": "Zoë"}], "meta": {"a": {"b": '
                    '{"c": null}}}}}} I hope that helps!',
     (None, [("create_event", {"event": {"title": "Team {sync}", "attendees": [{"name": "Zoë"}],
                                         "meta": {"a": {"b": {"c": None}}}}})])),
    ("llama3_json", "Paris is the capital of France.", None),
    ("llama3_json", '{"city": "Paris", "population": 2100000}', None),  # JSON, no call
    ("llama3_json", '{"name": "Alice", "age": 30}', None),
    ("llama3_json", "<|python_tag|>print('hi')", None),
    # pythonic (Llama 3.2 / 4, ToolACE)
    ("pythonic", '[get_weather(city="San Francisco", metric="celsius")]',
     (None, [("get_weather", {"city": "San Francisco", "metric": "celsius"})])),
    ("pythonic", "[get_weather(city='Paris', days=3), get_time()]",
     (None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})])),
    ("pythonic", '[book(flights=[{"from": "SFO", "legs": [1, 2]}], options={"meal": None, '
                 '"upgrade": True, "price": -12.5}, note="a, b (c) [d] \\"q\\" ]")]',
     (None, [("book", {"flights": [{"from": "SFO", "legs": [1, 2]}],
                       "options": {"meal": None, "upgrade": True, "price": -12.5},
                       "note": 'a, b (c) [d] "q" ]'})])),
    ("pythonic", '<|python_start|>[search(query="vllm tool calling")]<|python_end|>',
     (None, [("search", {"query": "vllm tool calling"})])),
    ("pythonic", '[run(code="""print(\'x\')\nprint("y")"""), translate(text="日本語", '
                 'empty="")]',
     (None, [("run", {"code": "print('x')\nprint(\"y\")"}),
             ("translate", {"text": "日本語", "empty": ""})])),
    ("pythonic", "[1, 2, 3]", None),
    ("pythonic", "[Note: this is not a call]", None),
    ("pythonic", "[Paris](https://en.wikipedia.org/wiki/Paris) is nice.", None),
    ("pythonic", "get_weather(city='Paris')", None),
    ("pythonic", "[get_weather(city=Paris)]", None),  # not a literal
    ("pythonic", '[get_weather("Paris")]', None),  # positional
    ("pythonic", "[]", None),
    # tool_choice="required": vLLM's array of {"name", "parameters"}
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
     (None, [("get_weather", {"city": "Paris"})])),
    ("required", '[\n  {"name": "a", "parameters": {"x": "}]"}},\n  {"name": "b", '
                 '"parameters": {}}\n]',
     (None, [("a", {"x": "}]"}), ("b", {})])),
    ("required", '[{"name": "a", "parameters": {"x": 1}}, {"na',  # truncated: complete calls
     (None, [("a", {"x": 1})])),
    ("required", "Sorry, I cannot.", None),
    # a named function: the output is its arguments
    ("named:get_weather", '{"city": "Paris", "days": [1, 2]}',
     (None, [("get_weather", {"city": "Paris", "days": [1, 2]})])),
    ("named:get_weather", ' \n{"city": "Zürich"}\n ',
     (None, [("get_weather", {"city": "Zürich"})])),
]

# Invalid after a call went out (its name): the whole text is content (as vLLM), which a stream
# cannot take back (vLLM's neither); one that sees the error before sending the name sends content.
BROKEN_AFTER_NAME = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n'
               "</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{x}'),
]


def _case_id(case: tuple) -> str:
    return f"{case[0]}:{case[1][:30]!r}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_whole_text(case: tuple) -> None:
    name, text, expected = case
    info = parser_factory(name)().extract_tool_calls(text, REQUEST)
    if expected is None:
        assert (info.tools_called, info.tool_calls, info.content) == (False, [], text)
        return
    content, calls = expected
    assert info.tools_called
    assert info.content == content
    assert [(call.function.name, json.loads(call.function.arguments))
            for call in info.tool_calls] == calls
    for call in info.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"


def _cuts(text: str) -> Iterator[list[str]]:
    """The text one character per delta, whole, and split in two at every position."""
    yield list(text)
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict[str, str]]]:
    """The content and calls a stream sends, checking each delta's form."""
    content, calls, previous = "", [], ""
    for piece in pieces:
        current = previous + piece
        delta = parser.extract_tool_calls_streaming(previous, current, piece, [], [], [],
                                                    REQUEST)
        previous = current
        if delta is None:
            continue
        assert delta.content or delta.tool_calls, "an empty message"
        content += delta.content or ""
        for call in delta.tool_calls:
            function = call.function
            if call.index == len(calls):  # a new call: its name, once, with an id
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                assert function.name
                calls.append({"name": function.name, "arguments": function.arguments or ""})
            else:
                assert call.index < len(calls) and call.id is None and function.name is None
                assert function.arguments
                calls[call.index]["arguments"] += function.arguments
    return content, calls


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_streaming_adds_up_to_the_whole_text(case: tuple) -> None:
    name, text, _ = case
    make_parser = parser_factory(name)
    whole = make_parser().extract_tool_calls(text, REQUEST)
    whole_content = (whole.content or "") if whole.tools_called else text
    whole_calls = [{"name": call.function.name, "arguments": call.function.arguments}
                   for call in whole.tool_calls]
    for pieces in _cuts(text):
        content, calls = _stream(make_parser(), pieces)
        assert (content, calls) == (whole_content, whole_calls), pieces


@pytest.mark.parametrize("case", BROKEN_AFTER_NAME, ids=_case_id)
def test_invalid_after_the_name_is_content(case: tuple) -> None:
    name, text = case
    info = parser_factory(name)().extract_tool_calls(text, REQUEST)
    assert (info.tools_called, info.content) == (False, text)
    for pieces in _cuts(text):
        content, calls = _stream(parser_factory(name)(), pieces)
        if calls:
            assert content == "" and calls[0]["name"] in ("get_weather", "f")
        else:
            assert content == text


def test_held_back_marker_prefix_is_sent_by_the_whole_text() -> None:
    """A stream that ends inside what may be a "<tool_call>" holds it back; the whole-text
    content (which the server sends the rest of) has it."""
    text = "Let me use <tool_"
    content, calls = _stream(parser_factory("hermes")(), list(text))
    assert (content, calls) == ("Let me use ", [])
    assert parser_factory("hermes")().extract_tool_calls(text, REQUEST).content == text


def test_named_sends_the_name_first() -> None:
    parser = NamedToolCallParser("get_weather")
    first = parser.extract_tool_calls_streaming("", " ", " ", [], [], [], REQUEST)
    assert first.to_dict() == {"tool_calls": [{"index": 0, "id": first.tool_calls[0].id,
                                               "type": "function",
                                               "function": {"name": "get_weather"}}]}


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_adjust_request_keeps_special_tokens_with_tools(name: str) -> None:
    parser = parser_factory(name)()
    assert parser.adjust_request(Request(tools=REQUEST.tools)).skip_special_tokens is False
    assert parser.adjust_request(Request()).skip_special_tokens is None
    assert parser.adjust_request(Request(tools=REQUEST.tools, tool_choice="none")
                                 ).skip_special_tokens is None
    assert parser_factory("pythonic")().adjust_request(
        Request(tools=REQUEST.tools)).skip_special_tokens is None


def test_manager_names_the_known_parsers() -> None:
    assert {"hermes", "llama3_json", "pythonic"} <= set(ToolParserManager.names())
    with pytest.raises(ValueError, match=r"'nope'.*hermes.*pythonic"):
        ToolParserManager.get_tool_parser("nope")


def test_wire_shapes() -> None:
    call = ToolCall("chatcmpl-tool-1", FunctionCall("f", '{"a": 1}'))
    assert call.to_dict() == {"id": "chatcmpl-tool-1", "type": "function",
                              "function": {"name": "f", "arguments": '{"a": 1}'}}
    delta = DeltaToolCall(1, function=DeltaFunctionCall(arguments='{"a'))
    assert delta.to_dict() == {"index": 1, "function": {"arguments": '{"a'}}
    assert DeltaMessage(content="hi").to_dict() == {"content": "hi"}
    assert DeltaMessage(reasoning_content="r", tool_calls=[delta]).to_dict() == {
        "reasoning_content": "r", "tool_calls": [delta.to_dict()]}


@pytest.mark.parametrize(("text", "end"), [
    ('{"a": "}", "b": [1, {"c": "\\""}]} tail', 33), ("[1, [2]], 3", 8), ('"a\\"b" x', 6),
    ("-12.5e3,", 7), ("true}", 4), ('{"a": [1}', None), ("{", None),
])
def test_json_value_scan(text: str, end: int | None) -> None:
    """Where a value ends, whole and read one character at a time (None: error or
    incomplete)."""
    for pieces in (list(text), [text]):
        scan, seen = JsonValueScan(0), ""
        for piece in pieces:
            seen += piece
            scan.advance(seen)
        assert (scan.end if not scan.error else None) == end


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "required"])
def test_arguments_stream_as_they_arrive(name: str) -> None:
    """JSON arguments go out character by character, not at the call's end."""
    text = next(text for parser, text, expected in CASES if parser == name and expected)
    parser, pieces, fragments = parser_factory(name)(), list(text), 0
    previous = ""
    for piece in pieces:
        delta = parser.extract_tool_calls_streaming(previous, previous + piece, piece, [], [],
                                                    [], REQUEST)
        previous += piece
        fragments += sum(1 for call in (delta.tool_calls if delta else [])
                         if call.function.arguments)
    arguments = parser_factory(name)().extract_tool_calls(text, REQUEST).tool_calls[0]
    assert fragments >= len(arguments.function.arguments) - 1
