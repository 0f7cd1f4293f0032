"""Rollout engines: the built-in torch/transformers engine and the SGLang adapter."""
