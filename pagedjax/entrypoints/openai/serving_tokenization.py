"""POST /tokenize (a prompt, or messages through the chat template) and /detokenize."""

from __future__ import annotations

from typing import Any

from pagedjax.entrypoints.openai.errors import OpenAIError
from pagedjax.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedjax.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # its tokenizer, chat template and model check

    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        """On the tokenizer's thread, after the character bound (serving.py)."""
        chat = self.chat
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages.", param="prompt")
        if request.messages is not None:
            tokens = (await chat.render_async(
                request.messages, chat_template=request.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs))["prompt_token_ids"]
        else:
            tokens = await chat.encode_async(request.prompt, request.add_special_tokens)
        return {"count": len(tokens), "max_model_len": chat.max_model_len, "tokens": tokens}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        chat = self.chat
        chat.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < chat.vocab_size]
        if bad:
            raise OpenAIError(400, f"tokens {bad[:5]} are outside the vocabulary "
                                   f"[0, {chat.vocab_size}).", param="tokens")
        if chat.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer.", param="tokens")
        return {"prompt": chat.tokenizer.decode(request.tokens)}
