"""vLLM's usage patterns with only the import changed: each test is written the way vLLM's
examples and docs use its API (names, call shapes, output shapes), against a tiny checkpoint."""

from __future__ import annotations

import json

import jax
import pytest

from pagedjax import LLM, EngineArgs, LLMEngine, Logprob, RequestOutputKind, SamplingParams
from pagedjax.distributed import cleanup_dist_env_and_memory
from pagedjax.utils import FlexibleArgumentParser  # where vLLM keeps it (vllm.utils)

SMALL = dict(max_model_len=256, num_gpu_blocks_override=64)
PROMPTS = ["def fibonacci(n):", "import os\n", "class Config(object):", "for i in range("]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama")


def test_generate_a_list_of_prompts(model) -> None:
    llm = LLM(model=model, **SMALL)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, seed=0))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt == prompt and output.outputs[0].text
        assert output.finished and output.outputs[0].finish_reason in ("stop", "length")


def test_engine_args_on_the_command_line(model) -> None:
    """vLLM's generate.py: engine flags in an argument group, sampling flags beside them,
    everything else passed to LLM(**args), default sampling params adjusted in place."""
    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model=model)
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    args = vars(parser.parse_args(["--max_model_len", "256", "--max-tokens", "5",
                                   "--temperature", "0", "--num-gpu-blocks-override", "64"]))
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens, sampling_params.temperature = max_tokens, temperature
    outputs = llm.generate(PROMPTS[:2], sampling_params)
    assert all(len(o.outputs[0].token_ids) <= 5 for o in outputs)


def test_prefix_caching_on_and_off_two_engines_in_one_process(model) -> None:
    """vLLM's prefix-caching example: one engine with caching, released, then one without;
    greedy output is the same, and the second engine reuses the freed memory."""
    shared = "You are a helpful assistant for Python code. " * 8
    prompts = [shared + "Question: what does zip do?", shared + "Question: what is a set?"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    cached = LLM(model=model, enable_prefix_caching=True, **SMALL)
    with_cache = [o.outputs[0].text for o in cached.generate(prompts, params)]
    assert cached.generate(prompts[1], params)[0].num_cached_tokens > 0
    runner = cached.engine.runner
    arrays = [runner.kv_caches[0][0], *jax.tree.leaves(runner.target.params)]
    del cached, runner
    cleanup_dist_env_and_memory()
    assert all(a.is_deleted() for a in arrays)  # the first engine's weights and caches are gone
    del arrays
    uncached = LLM(model=model, enable_prefix_caching=False, **SMALL)
    assert [o.outputs[0].text for o in uncached.generate(prompts, params)] == with_cache
    uncached.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        uncached.generate(prompts, params)


def test_engine_loop_with_n_and_logprobs(model) -> None:
    """vLLM's llm_engine_example: add requests, step until none is unfinished."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **SMALL))
    requests = [("a", PROMPTS[0], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6,
                                                  logprobs=2, prompt_logprobs=1)),
                ("b", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))]
    finished = {}
    while requests or engine.has_unfinished_requests():
        if requests:
            engine.add_request(*requests.pop(0))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    sampled = finished["a"].outputs
    assert len(sampled) == 2 and all(len(c.logprobs) == len(c.token_ids) == 6 for c in sampled)
    assert all(c.token_ids[0] in c.logprobs[0] for c in sampled)
    first = sampled[0].logprobs[0][sampled[0].token_ids[0]]
    assert isinstance(first, Logprob) and first.logprob <= 0.0 and first.decoded_token is not None
    assert first.rank >= 1
    prompt_logprobs = finished["a"].prompt_logprobs  # vLLM's shape: None, then one dict a token
    assert len(prompt_logprobs) == len(finished["a"].prompt_token_ids)
    assert prompt_logprobs[0] is None and all(
        token in entry and len(entry) <= 2 and isinstance(entry[token], Logprob)
        for token, entry in zip(finished["a"].prompt_token_ids[1:], prompt_logprobs[1:]))
    assert finished["b"].prompt_logprobs is None
    assert len(finished["b"].outputs[0].token_ids) == 4


def test_speculative_decoding_with_vllms_config(model, tiny_model) -> None:
    llm = LLM(model=model, speculative_config={"method": "draft_model",
                                               "model": tiny_model("draft"),
                                               "num_speculative_tokens": 3}, **SMALL)
    plain = LLM(model=model, **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)])
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0


def test_delta_streaming(model) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **SMALL))
    delta = SamplingParams(temperature=0.0, max_tokens=10,
                           output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", PROMPTS[2], delta)
    pieces, tokens = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].text)
            tokens += output.outputs[0].token_ids
    whole = LLM(model=model, **SMALL).generate(PROMPTS[2], SamplingParams(temperature=0.0,
                                                                          max_tokens=10))
    assert "".join(pieces) == whole[0].outputs[0].text
    assert tokens == whole[0].outputs[0].token_ids


def test_default_sampling_params_come_from_the_generation_config(model, tmp_path) -> None:
    import shutil

    shutil.copytree(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, max_new_tokens=7)
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(config))
    params = LLM(model=str(tmp_path / "m"), **SMALL).get_default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 7)


def test_chat_with_the_models_template(model, tmp_path) -> None:
    """vLLM's chat example: one conversation, then a batch of them, through the tokenizer's
    chat template; a model without one needs chat_template=."""
    import shutil

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    shutil.copytree(model, tmp_path / "chat")
    (tmp_path / "chat" / "chat_template.jinja").write_text(template)
    llm = LLM(model=str(tmp_path / "chat"), **SMALL)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write a function that sorts a list."},
    ]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert outputs[0].prompt == text and text.endswith("<|assistant|>")
    assert outputs[0].prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    same = llm.generate({"prompt_token_ids": outputs[0].prompt_token_ids}, sampling_params)
    assert outputs[0].outputs[0].text == same[0].outputs[0].text
    assert len(llm.chat([conversation, conversation[:2]], sampling_params, use_tqdm=False)) == 2
    plain = LLM(model=model, **SMALL)
    with pytest.raises(ValueError, match="no chat template"):
        plain.chat(conversation, sampling_params)
    assert plain.chat(conversation, sampling_params, chat_template=template,
                      use_tqdm=False)[0].outputs[0].text == outputs[0].outputs[0].text


def test_async_llm_streaming(model) -> None:
    """vLLM's async_llm_streaming example: AsyncEngineArgs → AsyncLLM.from_engine_args, DELTA
    outputs from `generate(request_id=..., prompt=..., sampling_params=...)`, shutdown()."""
    import asyncio

    from pagedjax import AsyncEngineArgs, AsyncLLM

    engine_args = AsyncEngineArgs(model=model, **SMALL)
    engine = AsyncLLM.from_engine_args(engine_args)
    sampling_params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=42,
                                     output_kind=RequestOutputKind.DELTA)

    async def stream_response(prompt: str, request_id: str) -> str:
        text = ""
        async for output in engine.generate(request_id=request_id, prompt=prompt,
                                            sampling_params=sampling_params):
            for completion in output.outputs:
                text += completion.text
            if output.finished:
                break
        return text

    async def main() -> list[str]:
        return await asyncio.gather(*[stream_response(p, f"stream-{i}")
                                      for i, p in enumerate(PROMPTS)])

    try:
        streamed = asyncio.run(main())
    finally:
        engine.shutdown()
    offline = LLM(model=model, **SMALL).generate(PROMPTS, SamplingParams(
        max_tokens=10, temperature=0.8, top_p=0.95, seed=42), use_tqdm=False)
    assert streamed == [o.outputs[0].text for o in offline]


def test_beam_search(model) -> None:
    """vLLM's beam search: `LLM.beam_search(prompts, BeamSearchParams(beam_width=...,
    max_tokens=...))`, one BeamSearchOutput per prompt whose `sequences` are best first, each
    with `tokens` (prompt included), `text`, `cum_logprob` and per-token `logprobs`."""
    from pagedjax import BeamSearchParams

    llm = LLM(model=model, **SMALL)
    prompts = [{"prompt": p} for p in PROMPTS[:2]]
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8,
                                                        ignore_eos=True))
    assert len(outputs) == 2
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = llm.get_tokenizer()(prompt)["input_ids"]
        assert len(output.sequences) == 3
        scores = [s.cum_logprob / (len(s.tokens) - len(prompt_ids)) for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        for beam in output.sequences:
            assert beam.tokens[: len(prompt_ids)] == prompt_ids
            assert len(beam.tokens) == len(prompt_ids) + 8
            assert len(beam.logprobs) == 8
            generated = beam.tokens[len(prompt_ids):]
            assert all(isinstance(entry[token], Logprob)
                       for entry, token in zip(beam.logprobs, generated))
    # Width 1 is greedy.
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True), use_tqdm=False)
    width_1 = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=8,
                                                             ignore_eos=True))[0].sequences[0]
    assert width_1.tokens[-8:] == greedy[0].outputs[0].token_ids
