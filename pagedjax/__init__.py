"""pagedjax: a vLLM-style LLM inference engine with JAX (Pallas) and PyTorch (CUDA) backends.

The core imports neither jax nor torch; a backend's framework loads when an engine picks it.
"""

from pagedjax.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedjax.engine.async_llm import AsyncEngineArgs, AsyncLLM
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine_args import EngineArgs
from pagedjax.entrypoints.llm import LLM
from pagedjax.outputs import CompletionOutput, Logprob, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedjax.utils import FlexibleArgumentParser

__all__ = ["LLM", "LLMEngine", "EngineArgs", "FlexibleArgumentParser", "SamplingParams",
           "RequestOutputKind", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "AsyncLLM", "AsyncEngineArgs", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence"]
__version__ = "0.1.0"
