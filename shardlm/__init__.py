"""shardlm: run and train large language models across many devices with every parallel strategy."""

from shardlm.engine.llm import LLM, RequestOutput
from shardlm.engine.sampling import SamplingParams
from shardlm.parallel.dims import ParallelDims

__all__ = ["LLM", "RequestOutput", "SamplingParams", "ParallelDims"]
__version__ = "0.1.0"
