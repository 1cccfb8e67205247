"""Bad input gets a ValueError naming the value and the fix; the engine keeps serving, no leaks."""

from __future__ import annotations

import pytest

from pagedjax import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), backend="jax", max_model_len=64, num_gpu_blocks_override=16)


@pytest.mark.parametrize("prompt, params, match", [
    ("", GREEDY, "empty"),
    ({"prompt_token_ids": []}, GREEDY, "empty"),
    ({"prompt_token_ids": [1, 10**6]}, GREEDY, r"\[1000000\].*vocabulary"),
    ({"prompt_token_ids": [-3]}, GREEDY, r"\[-3\].*vocabulary"),
    ("x" * 10, SamplingParams(max_tokens=60), "max_model_len=64"),
    ({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=None), "max_model_len=64"),
    ("hi", SamplingParams(n=1000), "n=1000.*max_num_seqs"),
    ("hi", SamplingParams(logit_bias={3: 1.0, 10**6: -1.0}),
     r"logit_bias has token ids \[1000000\] outside the vocabulary"),
])
def test_bad_request_is_rejected_and_engine_keeps_serving(llm: LLM, prompt, params,
                                                          match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params, use_tqdm=False)
    assert llm.generate(["def f():"], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason
    metrics = llm.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]
    assert metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0


def test_a_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["ok", "fine", ""], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["ok", "fine"], GREEDY, use_tqdm=False)) == 2


def test_prompt_type_and_params_count(llm: LLM) -> None:
    with pytest.raises(TypeError, match="prompt=42"):
        llm.generate([42], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY], use_tqdm=False)


def test_abort_frees_blocks_and_reports_abort(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("r1", "def long_function():", SamplingParams(max_tokens=40))
    engine.add_request("r2", "class A:", SamplingParams(max_tokens=3, n=2, temperature=1.0))
    engine.step()
    engine.step()
    assert engine.get_metrics()["kv_blocks_free"] < engine.get_metrics()["kv_blocks_total"]
    engine.abort_request("r1")
    engine.abort_request("no-such-request")
    while engine.has_unfinished_requests():
        engine.step()
    metrics = engine.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]
    with pytest.raises(ValueError, match="request_id='r3' is already in use"):
        engine.add_request("r3", "a", GREEDY)
        engine.add_request("r3", "b", GREEDY)
    engine.abort_request("r3")


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="tensorflow"), "backend='tensorflow' is unknown"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(block_size=12), "block_size=12"),
    (dict(num_gpu_blocks_override=3), "num_gpu_blocks_override=3 cannot hold one sequence"),
    (dict(max_model_len=10**6), "max_position_embeddings"),
    (dict(attention_impl="flash"), "attention_impl='flash'"),
])
def test_bad_engine_config(tiny_model, kwargs: dict, match: str) -> None:
    kwargs = {"max_model_len": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model("llama"), **kwargs)


def test_missing_model_dir_and_unsupported_architecture(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), "n=0"), (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-5), "top_k=-5"), (dict(min_p=1.5), "min_p=1.5"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens=5"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logprobs=99), "logprobs=99"),
    (dict(seed="x"), "seed='x'"),
    (dict(presence_penalty=2.5), r"presence_penalty=2.5 .*\[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty=-3 .*\[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 .*> 0"),
    (dict(repetition_penalty="1.1"), "repetition_penalty='1.1'"),
    (dict(logit_bias=[1, 2]), r"logit_bias=\[1, 2\]"),
    (dict(logit_bias={"the": 1.0}), "logit_bias={'the': 1.0}"),
    (dict(logit_bias={-4: 1.0}), "logit_bias={-4: 1.0}"),
    (dict(logit_bias={4: float("inf")}), "logit_bias={4: inf}"),
    (dict(prompt_logprobs=21), "prompt_logprobs=21"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_invalid_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalisation() -> None:
    params = SamplingParams(stop="###", top_k=-1, temperature=0.0)
    assert params.stop_strings == ("###",) and params.top_k == 0 and params.is_greedy
    assert not params.has_penalties and params.logit_bias is None
    params = SamplingParams(logit_bias={"12": 250, 3: -101.5, 4: 0.25}, repetition_penalty=1.1)
    assert params.logit_bias == {12: 100.0, 3: -100.0, 4: 0.25}  # OpenAI's JSON ids, clamped
    assert params.has_penalties
