"""Where vLLM's example scripts import their helpers from (`vllm.utils`), so that changing the
import line is all a vLLM script needs."""

from pagedjax.engine_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
