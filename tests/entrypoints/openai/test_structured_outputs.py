"""Structured outputs through the OpenAI-compatible server: OpenAI's response_format (json_schema,
json_object) and vLLM's structured_outputs body field (choice, regex, ...), streamed and not,
with the official openai client; invalid constraints are 400s and the server keeps serving;
/metrics counts constrained requests and grammar compiles. The tiny model is random: the mask
makes any finished output valid, so each check asserts finish_reason "stop" and validity."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import jsonschema
import openai
import pytest

from pagedjax.entrypoints.openai.errors import OpenAIError
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedjax.entrypoints.openai.sampling import to_sampling_params
from pagedjax.sampling_params import StructuredOutputsParams
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE, MODEL_NAME, start_server

MESSAGES = [{"role": "user", "content": "Pick a color and a size."}]
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["color", "size"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-f]{2,4}-[0-9]{1,3}"


# ---- the request body → StructuredOutputsParams, no server ------------------------------------

def structured(body: dict[str, Any], chat: bool = False) -> StructuredOutputsParams | None:
    request = (ChatCompletionRequest(messages=MESSAGES, **body) if chat
               else CompletionRequest(prompt="x", **body))
    return to_sampling_params(request, max_tokens=8, logprobs=None,
                              defaults={}).structured_outputs


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": JSON_SCHEMA_FORMAT}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"choice": CHOICES}}, StructuredOutputsParams(choice=CHOICES)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutputsParams(grammar='root ::= "a"')),
])
@pytest.mark.parametrize("chat", [False, True])
def test_body_to_structured_outputs_params(body, want, chat) -> None:
    assert structured(body, chat) == want


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "not both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"structured_outputs": {"choice": CHOICES, "typo": 1}}, "structured_outputs", "typo"),
    ({"structured_outputs": {"regex": "a", "choice": CHOICES}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "json_object"),
])
def test_bad_structured_outputs_body_is_a_400(body, param, message) -> None:
    with pytest.raises(OpenAIError) as error:
        structured(body)
    assert (error.value.status, error.value.param) == (400, param)
    assert message in error.value.message


# ---- against a real server --------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(chat_model):
    server = start_server(chat_model, backend="torch", max_model_len=256,
                          num_gpu_blocks_override=64)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, **{"max_completion_tokens": 64, "seed": 0,
                                                **kwargs})


def complete(client, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt="The answer is",
                                     **{"max_tokens": 64, "seed": 0, **kwargs})


@pytest.fixture(scope="module")
def compact(server) -> dict[str, int]:
    """logit_bias that keeps whitespace-only tokens out: JSON allows any amount of whitespace,
    and a random model picks it so often that objects may not close within max_tokens."""
    tokenizer = server.engine.tokenizer
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    return {str(i): -100 for i, text in texts.items() if text and not text.strip()}


def test_chat_json_schema(client, compact) -> None:
    reply = chat(client, response_format=JSON_SCHEMA_FORMAT, logit_bias=compact).choices[0]
    assert reply.finish_reason == "stop", reply.message.content
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)
    chunks = list(chat(client, response_format=JSON_SCHEMA_FORMAT, logit_bias=compact, seed=1,
                       stream=True))
    choices = [c.choices[0] for c in chunks if c.choices]
    text = "".join(c.delta.content or "" for c in choices)
    assert choices[-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_mixture_of_experts_serves_structured_outputs(tiny_model, tmp_path, backend: str
                                                         ) -> None:
    """A Mixtral (its engine core in a process of its own, as `pagedjax serve` runs it): a JSON
    schema, streamed and not, and a choice, each valid and finished by the grammar."""
    model = shutil.copytree(tiny_model("mixtral"), tmp_path / "moe")
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    moe = start_server(str(model), backend=backend, max_model_len=256,
                       num_gpu_blocks_override=64)
    try:
        moe_client = openai.OpenAI(base_url=moe.base_url, api_key="unused", max_retries=0)
        tokenizer = moe.engine.tokenizer
        compact = {str(i): -100 for i in range(len(tokenizer))
                   if (text := tokenizer.decode([i])) and not text.strip()}
        reply = chat(moe_client, response_format=JSON_SCHEMA_FORMAT,
                     logit_bias=compact).choices[0]
        assert reply.finish_reason == "stop", reply.message.content
        jsonschema.validate(json.loads(reply.message.content), SCHEMA)
        chunks = [c.choices[0] for c in chat(moe_client, response_format=JSON_SCHEMA_FORMAT,
                                             logit_bias=compact, seed=1, stream=True)
                  if c.choices]
        text = "".join(c.delta.content or "" for c in chunks)
        assert chunks[-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        picked = complete(moe_client, n=2, temperature=1.0,
                          extra_body={"structured_outputs": {"choice": CHOICES}}).choices
        assert all(c.text in CHOICES and c.finish_reason == "stop" for c in picked), picked
    finally:
        moe.stop()


def test_chat_json_object(server, client) -> None:
    """Any object: a random model wanders inside strings, so "{", "}" and EOS are pushed up;
    the mask lets each through only where JSON allows it (unconstrained, EOS would come first)."""
    tokenizer = server.engine.tokenizer
    bias = {str(tokenizer.encode(c, add_special_tokens=False)[0]): 100 for c in "{}"}
    bias[str(tokenizer.eos_token_id)] = 100
    reply = chat(client, response_format={"type": "json_object"}, temperature=0,
                 logit_bias=bias).choices[0]
    assert reply.finish_reason == "stop", reply.message.content
    assert isinstance(json.loads(reply.message.content), dict)
    unconstrained = chat(client, temperature=0, logit_bias=bias).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(unconstrained)


def test_completion_choice_and_regex(client) -> None:
    choices = complete(client, n=3, temperature=1.0,
                       extra_body={"structured_outputs": {"choice": CHOICES}}).choices
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in choices), choices
    streamed = complete(client, stream=True, extra_body={"structured_outputs": {"regex": REGEX}})
    chunks = [c.choices[0] for c in streamed]
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("structured_outputs, name", [
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
     "no-such-type"),
    ({"regex": "[a-"}, None),
    ({"grammar": "root ::= undefined_rule"}, None),
])
def test_invalid_constraint_is_a_400_and_the_server_keeps_serving(client, structured_outputs,
                                                                   name) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        complete(client, extra_body={"structured_outputs": structured_outputs})
    assert error.value.status_code == 400 and error.value.body["param"] == "structured_outputs"
    if name is not None:
        assert name in error.value.body["message"]
    assert complete(client, max_tokens=4, extra_body={"ignore_eos": True}).choices[0].text


def test_invalid_schema_in_response_format_is_a_400(client) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}
    with pytest.raises(openai.BadRequestError, match="no-such-type") as error:
        chat(client, response_format=bad)
    assert error.value.body["param"] == "response_format"
    for response_format in ({"type": "xml"}, {"type": "json_schema"}):
        with pytest.raises(openai.BadRequestError) as error:
            chat(client, response_format=response_format)
        assert error.value.body["param"] == "response_format"
    assert chat(client, max_completion_tokens=4).choices[0].message.content is not None


def test_stream_options_need_stream(client) -> None:
    for stream in (False, None):
        extra = {} if stream is None else {"stream": stream}
        with pytest.raises(openai.BadRequestError, match="stream=True") as error:
            complete(client, stream_options={"include_usage": True}, **extra)
        assert error.value.body["param"] == "stream_options"
        with pytest.raises(openai.BadRequestError, match="stream=True"):
            chat(client, stream_options={"include_usage": True}, **extra)


def test_metrics_count_constrained_requests_and_compiles(server, client) -> None:
    before = server.metrics()
    complete(client, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    complete(client)  # no constraint: not counted
    after = server.metrics()
    name = "pagedjax:structured_output_requests_total"
    assert after[name] == before.get(name, 0) + 1
    assert after["pagedjax:grammar_compiles_total"] >= 1
    assert after["pagedjax:grammar_compile_seconds_total"] > 0
