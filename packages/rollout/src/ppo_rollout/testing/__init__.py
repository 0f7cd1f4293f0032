"""Test and benchmark helpers: a stand-in for an SGLang server (the same routes, served by the
built-in engine) and long-tailed response lengths (``long_tail``)."""
