"""Chat messages → one prompt through the tokenizer's chat template (LLM.chat and the server's
/v1/chat/completions share it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A message: {"role": str, "content": str | [{"type": "text", "text": str}, ...] | None, ...}
ChatMessage = dict[str, Any]


# Templates pagedjax ships, by name (--chat-template NAME): hermes_tool_use (ChatML with
# Hermes-style tool calls, for SmolLM2-Instruct and other ChatML models without tools).
SHIPPED_TEMPLATES = Path(__file__).resolve().parent / "chat_templates"


def shipped_chat_templates() -> list[str]:
    return sorted(p.stem for p in SHIPPED_TEMPLATES.glob("*.jinja"))


def load_chat_template(chat_template: str | None) -> str | None:
    """A Jinja template given inline, as a file path, or by the name of one pagedjax ships
    (vLLM's --chat-template)."""
    if chat_template is None:
        return None
    if "{" not in chat_template:
        path = Path(chat_template)
        if not path.is_file():
            path = SHIPPED_TEMPLATES / f"{chat_template}.jinja"
        if not path.is_file():
            raise ValueError(f"chat_template={chat_template!r} is neither a file, a Jinja "
                             f"template nor a shipped template ({shipped_chat_templates()}); "
                             "pass a path to a .jinja file, the template itself, or one of "
                             "those names.")
        return path.read_text()
    return chat_template


def parse_chat_messages(messages: Any) -> list[ChatMessage]:
    """Check the messages' shape; text content parts are joined with newlines (text only)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages={messages!r} must be a non-empty list of "
                         "{'role': ..., 'content': ...} dicts.")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}]={message!r} must be a dict with a string 'role'.")
        parsed.append({**message, "content": _text_content(i, message.get("content"))})
    return parsed


def _text_content(i: int, content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content={content!r} must be a string or a list of "
                         "text parts.")
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise ValueError(f"messages[{i}].content part {part!r} is not supported; this "
                             "server takes text parts only: {'type': 'text', 'text': ...}.")
        texts.append(part["text"])
    return "\n".join(texts)


def apply_chat_template(tokenizer: Any, messages: Any, *, chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The conversation as a prompt: {"prompt": text, "prompt_token_ids": ids}.

    chat_template: overrides the tokenizer's own. The template writes any special tokens itself,
    so the text is tokenized without adding more.
    """
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot apply a chat template; "
                         "send prompt token ids to the completions API instead.")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template "
                         "(a Jinja template; `pagedjax serve --chat-template FILE`) or use the "
                         "completions API.")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true; "
                         "set add_generation_prompt=False to continue the final message.")
    conversation = parse_chat_messages(messages)
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except (TemplateError, TypeError, KeyError, IndexError) as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from e
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
