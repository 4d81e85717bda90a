"""Serving: a tiny engine that generates with kvarn-jax paged quantized caches (see engine.py)."""

from .allocator import BlockAllocator, OutOfBlocksError
from .engine import CachePool, Engine, EngineStats, Result
from .runner import ModelRunner
from .sampling import SamplingParams, sample

__all__ = ["Engine", "SamplingParams", "Result", "EngineStats", "CachePool", "BlockAllocator", "OutOfBlocksError",
           "ModelRunner", "sample"]
