"""Reference engines for tests: a tensor-holding engine (usable as a Ray actor) and an HTTP server that
serves SGLang's weight routes on 127.0.0.1. Both use :class:`~ppo_weight_sync.WeightReceiver`."""

from ppo_weight_sync.testing.engine import TensorEngine, llama_like_spec, make_weights

__all__ = ["TensorEngine", "llama_like_spec", "make_weights"]
