"""FlexibleArgumentParser: argparse that also takes `--max_model_len`
(vllm/utils/argparse_utils.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that also accepts underscores in long options (`--max_model_len`), as
    vLLM's does."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([_dashes(a) for a in args], namespace)


def _dashes(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
