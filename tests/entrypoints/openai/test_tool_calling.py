"""Tool calling against a real server with the official openai client, on both backends:
forced calls (tool_choice "required" and named) valid by construction, with and without
speculation; "auto" parsed by each family's parser (the tiny random model is steered into a
family's format by a regex constraint), whole and streamed; multi-turn with tool messages; the
400s of bad tools."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from pagedjax.entrypoints.chat_utils import apply_chat_template, load_chat_template
from pagedjax.entrypoints.openai.api_server import ServerConfig, build_app
from pagedjax.entrypoints.openai.tool_choice import tool_messages_for_template
from pagedjax.testing.checkpoints import make_tiny_checkpoint
from tests.conftest import TINY_MODELS
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE, MODEL_NAME, serve_app, start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                  "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ENGINE = dict(max_model_len=1536, num_gpu_blocks_override=384, max_num_seqs=16,
              max_num_batched_tokens=256)
# Each family's format, forced on the random model with a regex; the parser finds the call.
CITY = "[a-z]{1,8}"
FAMILIES = {
    "hermes": ("Let me check\\.\n<tool_call>\n\\{\"name\": \"get_weather\", \"arguments\": "
               f"\\{{\"city\": \"{CITY}\", \"unit\": \"celsius\"\\}}\\}}\n</tool_call>"),
    "llama3_json": (f"\\{{\"name\": \"get_weather\", \"parameters\": \\{{\"city\": \"{CITY}\", "
                    "\"unit\": \"celsius\"\\}\\}"),
    "pythonic": f"\\[get_weather\\(city=\"{CITY}\", unit=\"celsius\"\\)\\]",
}


@pytest.fixture(scope="module")
def tool_model(tokenizer, tmp_path_factory) -> str:
    """The tiny llama with room for the tool-use template's prompts (2048 positions)."""
    out = make_tiny_checkpoint(tmp_path_factory.mktemp("tools"), "llama", tokenizer=tokenizer,
                               max_position_embeddings=2048)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(out)


@pytest.fixture(scope="module", params=["torch", "jax"])
def server(request, tool_model):
    """A server per backend, and one app per tool-call parser over the same engine (with the
    shipped Hermes tool-use template): (Server, {"default": url, "hermes": url, ...})."""
    main = start_server(tool_model, backend=request.param, **ENGINE)
    urls, extra = {"default": main.base_url}, []
    try:
        for family in FAMILIES:
            config = ServerConfig([MODEL_NAME], enable_auto_tool_choice=True,
                                  tool_call_parser=family,
                                  chat_template=load_chat_template("hermes_tool_use"))
            url, uv, thread = serve_app(build_app(main.engine, config))
            urls[family] = url + "/v1"
            extra.append((uv, thread))
        yield main, urls
    finally:
        for uv, thread in extra:
            uv.should_exit = True
            thread.join(timeout=30)
        main.stop()


@pytest.fixture(scope="module", params=["torch", "jax"])
def speculative_server(request, tool_model, tokenizer, tmp_path_factory):
    """tool_model with a tiny draft of the same context."""
    arch, overrides = TINY_MODELS["draft"]
    draft = make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), arch, tokenizer=tokenizer,
                                 max_position_embeddings=2048, **overrides)
    server = start_server(tool_model, backend=request.param,
                          speculative_config={"model": str(draft),
                                              "num_speculative_tokens": 2}, **ENGINE)
    yield server
    server.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0)


def assert_valid_calls(calls, names=None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def forced_request(i: int) -> dict:
    """Request i of the forced-call sample: named (each tool in turn) and required alternate;
    every fourth required request allows parallel calls."""
    choice = ("required" if i % 2 else
              {"type": "function", "function": {"name": TOOLS[i % 4 // 2]["function"]["name"]}})
    return dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=i % 8 == 3, temperature=1.0, seed=i, max_tokens=200)


def check_forced_sample(url: str) -> None:
    """50 sampled forced requests at once: every call names an allowed tool and its arguments
    match the tool's schema, 100 %."""
    async_client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)

    async def run():
        return await asyncio.gather(*(async_client.chat.completions.create(**forced_request(i))
                                      for i in range(50)))

    for i, response in enumerate(asyncio.run(run())):
        choice, request = response.choices[0], forced_request(i)
        assert choice.finish_reason == "tool_calls", (i, choice)
        named = request["tool_choice"] != "required"
        assert_valid_calls(choice.message.tool_calls,
                           [request["tool_choice"]["function"]["name"]] if named else None)
        if not request["parallel_tool_calls"]:
            assert len(choice.message.tool_calls) == 1
        assert not choice.message.content


def test_forced_calls_are_valid_in_every_sampled_request(server) -> None:
    check_forced_sample(server[1]["default"])


def test_forced_calls_are_valid_with_speculation(speculative_server) -> None:
    check_forced_sample(speculative_server.base_url)
    metrics = speculative_server.engine.get_metrics()
    assert metrics["spec_decode_num_draft_tokens"] > 0


def test_forced_call_streams_as_openai_does(server) -> None:
    """delta.tool_calls: the first carries the id, type and name; argument fragments follow;
    they add up to the whole response's call; finish_reason "tool_calls"."""
    request = forced_request(0) | {"temperature": 0.0}
    whole = client(server[1]["default"]).chat.completions.create(**request)
    chunks = list(client(server[1]["default"]).chat.completions.create(**request, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and not delta.function.name
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (expected,) = whole.choices[0].message.tool_calls
    assert list(calls) == [0] and calls[0]["name"] == expected.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(expected.function.arguments)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_calls_are_parsed_by_each_family(server, family) -> None:
    """tool_choice "auto": the model's text in the family's format becomes tool_calls, whole
    and streamed alike."""
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                   temperature=0.0, extra_body={"structured_outputs": {"regex": FAMILIES[family]}})
    whole = client(server[1][family]).chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["unit"] == "celsius" and arguments["city"].isalpha()
    assert (choice.message.content or "").strip() == ("Let me check." if family == "hermes"
                                                      else "")
    content, streamed = "", {}
    for chunk in client(server[1][family]).chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta and delta.content) or ""
        for part in (delta and delta.tool_calls) or []:
            entry = streamed.setdefault(part.index, {"name": part.function.name, "args": ""})
            entry["args"] += part.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            assert chunk.choices[0].finish_reason == "tool_calls"
    assert content.strip() == (choice.message.content or "").strip()
    assert list(streamed) == [0] and streamed[0]["name"] == "get_weather"
    assert json.loads(streamed[0]["args"]) == arguments


def test_auto_without_a_call_is_content(server) -> None:
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=12,
                   temperature=0.0)
    choice = client(server[1]["hermes"]).chat.completions.create(**request).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    plain = client(server[1]["hermes"]).chat.completions.create(
        **request | {"tool_choice": "none"}).choices[0]
    assert plain.message.tool_calls is None


def test_a_multi_turn_conversation_with_tool_messages(server, tool_model) -> None:
    """The assistant's calls and the tool's answer reach the template (arguments as objects),
    and the next turn runs."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    prompt = apply_chat_template(tokenizer, tool_messages_for_template(messages),
                                 chat_template=load_chat_template("hermes_tool_use"),
                                 chat_template_kwargs={"tools": TOOLS})["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt
    assert '"name": "add"' in prompt.split("\n</tools>")[0]
    response = client(server[1]["hermes"]).chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=96, temperature=0.0)
    assert_valid_calls(response.choices[0].message.tool_calls)


BAD = [
    ("tool_choice without tools", dict(tool_choice="required"), "tool_choice",
     "`tools` must be set"),
    ("an unknown function", dict(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
    ("an invalid schema", dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 5}}}}}]),
     "tools", "not a valid JSON schema"),
    ("auto without --enable-auto-tool-choice", dict(tools=TOOLS), "tool_choice",
     "--enable-auto-tool-choice"),
    ("a forced call with a response_format", dict(tools=TOOLS, tool_choice="required",
                                                  response_format={"type": "json_object"}),
     "tool_choice", "cannot be combined"),
    ("a bad function name", dict(tools=[{"type": "function", "function": {"name": "a b"}}]),
     "tools", ""),
]


@pytest.mark.parametrize("body, param, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tools_get_openai_400s(server, body, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client(server[1]["default"]).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **body)
    assert error.value.status_code == 400
    detail = error.value.body
    assert detail["param"] == param and message in detail["message"], detail
