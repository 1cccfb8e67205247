"""DeepSeek-R1 (and its distills): "<think>\n...</think>answer". Newer chat templates put the
<think> in the prompt, so the output may only close it: all text before </think> is reasoning,
and an output without </think> (it stopped while thinking) is all reasoning."""

from __future__ import annotations

from pagedjax.reasoning.abs_reasoning_parsers import ReasoningParserManager
from pagedjax.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    think_in_prompt = True
