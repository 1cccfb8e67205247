"""Helpers without a home of their own, where vLLM keeps them: `vllm.utils` is where its example
scripts import FlexibleArgumentParser from, so that changing the import line is all a vLLM
script needs."""

from pagedjax.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
