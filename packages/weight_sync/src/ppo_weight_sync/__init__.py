"""Trainer-to-inference-engine weight updates
over a dedicated process group, compatible with SGLang's HTTP API."""

__version__ = "0.1.0"
