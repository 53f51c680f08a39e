"""``InferenceEngineConformance`` on a real vLLM (0.32, CPU build), through both adapters:
``VLLMHTTPEngine`` against ``vllm serve`` (the tied Qwen2) and ``VLLMEngine`` over an
in-process ``AsyncLLM`` (the untied Llama). The version laws load real tensors (the model's
own checkpoint) through the worker extension, so every load runs vLLM's in-place reload."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import live
import torch
from asyncflow_conformance import InferenceEngineConformance
from asyncflow_vllm import VLLMHTTPEngine


class _Live(InferenceEngineConformance):
    key = "qwen2"
    long_max_tokens = 1536  # a few seconds each (live.MAX_MODEL_LEN)
    timeout_s = 120.0
    real_timeout_s = 600.0
    context_window = live.MAX_MODEL_LEN

    def prompt_tokens(self, index: int) -> Sequence[int]:
        vocab = live.vocab_size(self.key)
        return tuple(4 + (7 * index + 3 * k) % (vocab - 4) for k in range(4))

    def weights_for_load(self, engine: Any) -> Sequence[tuple[str, torch.Tensor]]:
        return live.checkpoint(self.key)

    async def close_engine(self, engine: Any) -> None:
        await live.reset(engine)


class TestLiveHTTPEngine(_Live):
    """A fresh client per law, one server for all."""

    key = "qwen2"

    @classmethod
    def setup_class(cls) -> None:
        cls.url = live.server(cls.key).url
        cls.vocab_size = live.vocab_size(cls.key)

    async def make_engine(self) -> VLLMHTTPEngine:
        engine = VLLMHTTPEngine(self.url, ignore_eos=True)
        await engine.connect()
        return engine


class TestLiveInProcessEngine(_Live):
    """One ``AsyncLLM`` for all laws, on its own loop (``EngineHost``)."""

    key = "llama"

    @classmethod
    def setup_class(cls) -> None:
        cls.host = live.host(cls.key)
        cls.vocab_size = live.vocab_size(cls.key)

    def progress(self, engine: Any) -> Any:
        # the deltas the adapter has streamed (vLLM sends one per engine step): evidence for
        # the laws that act on requests in flight, the version-label laws among them
        return engine.streamed_tokens

    def make_engine(self) -> Any:
        return self.host.proxy()
