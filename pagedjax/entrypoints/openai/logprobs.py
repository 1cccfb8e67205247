"""CompletionOutput.logprobs (per token: {token id: Logprob}) → OpenAI's two JSON shapes."""

from __future__ import annotations

from typing import Any

from pagedjax.outputs import Logprob, Logprobs

_FLOOR = -9999.0  # JSON has no -inf


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, _FLOOR)


def _text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


def _top(position: dict[int, Logprob], num_top: int) -> list[Logprob]:
    """The num_top most likely tokens, by rank (the sampled token is listed separately)."""
    ranked = sorted((lp for lp in position.values() if lp.rank is not None),
                    key=lambda lp: lp.rank)
    return ranked[:num_top]


def completion_logprobs(token_ids: list[int], logprobs: Logprobs, num_top: int,
                        text_offset: int) -> dict[str, Any]:
    """Completions' shape: text_offset, token_logprobs, tokens, top_logprobs (the sampled token
    and the top num_top per position, as vLLM). text_offset: where the first token's text
    starts in the choice's text (after an echoed prompt, or after earlier chunks)."""
    offsets, values, tokens, tops = [], [], [], []
    for token, position in zip(token_ids, logprobs):
        sampled = position[token]
        offsets.append(text_offset)
        text_offset += len(_text(sampled))
        values.append(_value(sampled))
        tokens.append(_text(sampled))
        top = {_text(lp): _value(lp) for lp in reversed(_top(position, num_top))}
        top[_text(sampled)] = _value(sampled)  # tokens that decode alike share a key
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
            "top_logprobs": tops}


def _chat_entry(logprob: Logprob) -> dict[str, Any]:
    text = _text(logprob)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: Logprobs, num_top: int) -> dict[str, Any]:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for token, position in zip(token_ids, logprobs):
        entry = _chat_entry(position[token])
        entry["top_logprobs"] = [_chat_entry(lp) for lp in _top(position, num_top)]
        content.append(entry)
    return {"content": content, "refusal": None}


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None] | None) -> Any:
    """RequestOutput.prompt_logprobs (when the engine gives them) in vLLM's JSON shape."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else
            {str(tid): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in position.items()}
            for position in prompt_logprobs]
