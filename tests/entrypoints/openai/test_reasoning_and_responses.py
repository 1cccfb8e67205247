"""Reasoning outputs and the Responses API against a real server (the official openai client,
both backends), and the engine's side of a reasoning parser: a structured output constrains
the answer after `</think>`, not the reasoning (LLM, greedy, with and without speculation).

The model is the tiny random llama with `<think>` / `</think>` added to its tokenizer and the
`</think>` row of its LM head pointed along the mean hidden state, so greedy decoding reasons a
few tokens and closes the reasoning; the chat template opens it (DeepSeek-R1's way)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.sampling_params import StructuredOutputsParams
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE, MODEL_NAME, start_server

THINK_TEMPLATE = CHAT_TEMPLATE + "{% if add_generation_prompt %}<think>\n{% endif %}"
ENGINE = dict(max_model_len=256, num_gpu_blocks_override=128, max_num_seqs=8,
              max_num_batched_tokens=128, reasoning_parser="deepseek_r1")
MESSAGES = [{"role": "user", "content": "Is Paris in France?"}]
CHOICE = {"choice": ["yes", "no"]}
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="session")
def think_model(tiny_model, tokenizer, tmp_path_factory) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedjax.testing.checkpoints import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("think")
    tokenizer.save_pretrained(tmp / "tok")
    think_tokenizer = AutoTokenizer.from_pretrained(tmp / "tok")
    think_tokenizer.add_tokens(["<think>", "</think>"])  # not special: they stay in the text
    out = make_tiny_checkpoint(tmp / "model", "llama", tokenizer=think_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    end_id = think_tokenizer.convert_tokens_to_ids("</think>")
    ids = torch.randint(1, end_id - 2, (8, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        direction = hidden.mean(0) / hidden.mean(0).norm()
        model.lm_head.weight[end_id] = direction * 3.0 / (hidden @ direction).mean()
    model.save_pretrained(out)
    (Path(out) / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return str(out)


@pytest.fixture(scope="module", params=["torch", "jax"])
def server(request, think_model):
    server = start_server(think_model, backend=request.param, **ENGINE)
    yield server
    server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


# ---- chat completions ------------------------------------------------------------------------

def test_reasoning_is_split_from_an_answer_the_grammar_constrains(server) -> None:
    request = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0.0,
                   extra_body={"structured_outputs": CHOICE})
    message = client(server).chat.completions.create(**request).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and "<think>" not in reasoning
    assert message.content in ("yes", "no")
    reasoning_parts, content_parts = [], []
    for chunk in client(server).chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        reasoning_parts.append((delta.model_extra or {}).get("reasoning_content") or "")
        content_parts.append(delta.content or "")
    assert "".join(reasoning_parts) == reasoning
    assert "".join(content_parts) == message.content


# ---- the Responses API -----------------------------------------------------------------------

def test_responses_whole_and_streamed(server) -> None:
    request = dict(model=MODEL_NAME, input="Is Paris in France?", instructions="Answer.",
                   max_output_tokens=60, temperature=0.0,
                   text={"format": {"type": "json_schema", "name": "answer", "schema": {
                       "type": "string", "enum": ["yes", "no"]}}})
    response = client(server).responses.create(**request)
    assert response.status == "completed" and response.object == "response"
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert json.loads(response.output_text) in ("yes", "no")
    reasoning_text = response.output[0].content[0].text
    assert reasoning_text and "</think>" not in reasoning_text
    usage = response.usage
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    events = list(client(server).responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index(
        "response.content_part.added")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == response.output_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == reasoning_text
    final = events[-1].response
    assert [item.type for item in final.output] == kinds
    assert final.output_text == response.output_text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.model_dump() for item in done] == [item.model_dump() for item in final.output]


def test_responses_function_calls_and_their_outputs(server) -> None:
    request = dict(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],
                   tool_choice={"type": "function", "name": "get_weather"},
                   max_output_tokens=80, temperature=0.0)
    response = client(server).responses.create(**request)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city"}

    events = list(client(server).responses.create(**request, stream=True))
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done.arguments and json.loads(streamed) == arguments

    follow_up = client(server).responses.create(
        model=MODEL_NAME, max_output_tokens=8, temperature=0.0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "21 degrees"}])
    assert follow_up.status in ("completed", "incomplete")
    assert follow_up.output[-1].type in ("message", "reasoning")


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"extra_body": {"frequency_penalty_x": 1}}, "frequency_penalty_x"),
])
def test_responses_refuses_what_it_cannot_do(server, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client(server).responses.create(**{"model": MODEL_NAME, "input": "hi",
                                           "max_output_tokens": 4, **body})
    assert error.value.body["param"] == param, error.value.body


# ---- the engine: a grammar after the reasoning, LLM.chat's split ------------------------------

def test_the_grammar_starts_after_the_reasoning_and_speculation_keeps_it(think_model) -> None:
    """With the reasoning parser the reasoning runs free and the answer follows the grammar;
    n-gram speculation gives the same greedy text; without a parser the grammar constrains
    from the first token."""
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    texts = []
    for speculative_config in (None, {"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3}):
        llm = LLM(think_model, backend="torch", speculative_config=speculative_config,
                  **ENGINE)
        try:
            (output,) = llm.chat(MESSAGES, params, use_tqdm=False)
        finally:
            llm.shutdown()
        completion = output.outputs[0]
        reasoning, _, answer = completion.text.partition("</think>")
        assert reasoning and answer in ("yes", "no"), completion.text
        assert (completion.reasoning_content, completion.content) == (reasoning, answer)
        texts.append(completion.text)
    assert texts[0] == texts[1]
    llm = LLM(think_model, backend="torch", **{**ENGINE, "reasoning_parser": None})
    try:
        (output,) = llm.chat(MESSAGES, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert output.outputs[0].text in ("yes", "no")
    assert output.outputs[0].reasoning_content is None


def test_a_reasoning_parser_the_tokenizer_cannot_serve_is_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match="'</think>' to be one token"):
        LLM(tiny_model("llama"), backend="torch", reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="qwen3"):
        LLM(tiny_model("llama"), backend="torch", reasoning_parser="nope")
