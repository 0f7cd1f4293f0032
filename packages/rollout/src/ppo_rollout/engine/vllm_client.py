"""vLLM adapter, the client: generation from token ids, memory release and the weights read back, over HTTP.

Generation goes through the OpenAI completions route (``POST /v1/completions``, vLLM 0.32.0's
``vllm/entrypoints/openai/completion/protocol.py`` ``CompletionRequest``): one request per prompt, its
``prompt`` the token ids, ``n`` the samples, ``seed`` the prompt's own (vLLM gives sample ``i`` the seed
``seed + i``, ``vllm/v1/engine/parallel_sampling.py``), ``logprobs: 0`` and ``return_token_ids`` for the
sampled tokens and their log-probs, ``max_tokens`` the prompt's limit; the prompts' requests run side by
side (the server batches them). Memory: ``POST /sleep?level=1&mode=keep`` and ``POST /wake_up`` (tags
``weights``, ``kv_cache``; ``vllm/entrypoints/serve/dev/sleep/api_router.py``); on CPU vLLM accepts
both and frees nothing. The weight operations are the endpoint's
(:class:`~ppo_weight_sync.vllm_endpoint.VLLMEngineEndpoint`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

from ppo_weight_sync import EngineReply
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint

from ..config import SamplingConfig
from .core import GenerationOutput
from .vllm_server import VLLMError

__all__ = ["VLLMClient", "completion_body"]

MEMORY_TAGS = ("weights", "kv_cache")


def completion_body(
    prompt: Sequence[int], sampling: SamplingConfig, seed: int, max_tokens: int, stop: Sequence[str]
) -> dict[str, Any]:
    """One prompt's ``/v1/completions`` body: its ``n`` samples, seeded, with their tokens and log-probs."""
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt],
        "n": sampling.n_samples_per_prompt,
        "max_tokens": int(max_tokens),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0: off, as in vLLM
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": False,
    }
    if sampling.stop_token_ids:
        body["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    if stop:
        body["stop"] = [str(s) for s in stop]
    return body


def _seed(base: int, position: int) -> int:
    """Prompt ``position``'s seed: distinct per prompt (its samples take ``seed + i`` in vLLM)."""
    return (base * 1_000_003 + position * 1_009) % (2**31 - 1)


class VLLMClient:
    """A vLLM server's generation and memory routes, beside its weight endpoint."""

    def __init__(self, endpoint: VLLMEngineEndpoint, *, parallel: int = 16) -> None:
        self.endpoint = endpoint
        self.name = endpoint.name
        self._pool = concurrent.futures.ThreadPoolExecutor(parallel, thread_name_prefix=f"vllm-{self.name}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int | None = None,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[Sequence[str]] | None = None,
    ) -> list[GenerationOutput]:
        """``n_samples_per_prompt`` samples of each prompt, prompt by prompt; ``max_new_tokens``: one
        limit per prompt; ``stop``: stop strings per prompt (vLLM's ``stop``, matched on decoded text)."""
        if not prompts:
            raise ValueError("generate needs at least one prompt; got an empty list")
        limits = (
            list(max_new_tokens) if max_new_tokens is not None else [sampling.max_new_tokens] * len(prompts)
        )
        if len(limits) != len(prompts) or any(int(n) < 1 for n in limits):
            raise ValueError(f"max_new_tokens needs one limit >= 1 per prompt, got {limits[:5]}")
        if stop is not None and len(stop) != len(prompts):
            raise ValueError(f"stop needs one entry per prompt: {len(stop)} for {len(prompts)} prompts")
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        if empty:
            raise ValueError(f"prompt {empty[0]} is empty; every prompt needs at least one token")
        base = sampling.seed if seed is None else seed
        bodies = [
            completion_body(
                p, sampling, (base * 1_000_003 + i) % (2**31 - 1), limits[i], stop[i] if stop else ()
            )
            for i, p in enumerate(prompts)
        ]
        futures = [self._pool.submit(self.endpoint.request, "POST", "/v1/completions", b) for b in bodies]
        out: list[GenerationOutput] = []
        for i, future in enumerate(futures):
            out.extend(self._parse(future.result(), i, sampling.n_samples_per_prompt))
        return out

    def _parse(self, reply: Any, position: int, n: int) -> list[GenerationOutput]:
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            raise VLLMError(f"vLLM server {self.name} refused prompt {position}: {str(reply)[:300]}")
        outputs = []
        for choice in sorted(choices, key=lambda c: int(c.get("index", 0))):
            ids = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            reason = choice.get("finish_reason")
            if reason not in ("stop", "length"):
                raise VLLMError(f"vLLM server {self.name}: prompt {position} finished with {reason!r}")
            if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
                raise VLLMError(
                    f"vLLM server {self.name}: prompt {position} came back without one log-prob per token "
                    f"(token_ids, logprobs.token_logprobs): {str(choice)[:200]}"
                )
            outputs.append(
                GenerationOutput(
                    prompt_position=position,
                    token_ids=tuple(int(t) for t in ids),
                    log_probs=tuple(float(x) for x in logprobs),
                    finish_reason=str(reason),
                )
            )
        return outputs

    # -- memory (on CPU vLLM accepts both and frees nothing) -------------------------------------------
    def release_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        """Sleep at level 1: the weights go to host memory, the KV cache is dropped; requests wait."""
        unknown = [t for t in tags or () if t not in MEMORY_TAGS]
        if unknown:
            return EngineReply.refused(f"unknown memory tags {unknown}; vLLM knows {list(MEMORY_TAGS)}")
        return self._call("/sleep?level=1&mode=keep")

    def resume_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        """Wake the tags (None: all); generation resumes once everything is back."""
        unknown = [t for t in tags or () if t not in MEMORY_TAGS]
        if unknown:
            return EngineReply.refused(f"unknown memory tags {unknown}; vLLM knows {list(MEMORY_TAGS)}")
        query = "&".join(f"tags={t}" for t in tags or ())
        return self._call("/wake_up" + (f"?{query}" if query else ""))

    def _call(self, route: str) -> EngineReply:
        body = self.endpoint.request("POST", route)
        if isinstance(body, dict) and ("error" in body or body.get("object") == "error"):
            return EngineReply.refused(f"vLLM server {self.name} refused {route}: {str(body)[:300]}")
        return EngineReply.ok(str(body))

    # -- weights read back (train.check_weights) -----------------------------------------------------
    def weights_checksum(self, rows: int | None = None) -> str:
        """The checksum the worker computes of its weights read back in Hugging Face names
        (:meth:`ppo_weight_sync.vllm_worker.WeightSyncExtension.ppo_weights_checksum`); equal to the
        actor's ``weights_checksum(rows)`` exactly when the weights are equal."""
        body = self.endpoint.rpc("ppo_weights_checksum", {"manifest": self.endpoint.expected, "rows": rows})
        results = body.get("results") if isinstance(body, dict) else None
        first = results[0] if isinstance(results, list) and results else None
        if not isinstance(first, dict) or "checksum" not in first:
            raise VLLMError(f"vLLM server {self.name} could not read its weights back: {str(body)[:300]}")
        return str(first["checksum"])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.endpoint.close()
