"""The generation core of the built-in engine: a plain class, usable without Ray.

Batched sampling from a Hugging Face causal LM with a KV cache. Prompts of different lengths are
left-padded into one batch, with an attention mask and position ids that start at 0 at each
prompt's first real token, so padding changes nothing the model sees.

Log-probs: each returned log-prob is ``log_softmax(logits / temperature)`` of the sampled token over
the whole vocabulary (``log_softmax(logits)`` when greedy) -- the distribution the trainer recomputes
at the same temperature, and what SGLang returns. It is the sampling distribution itself when
``top_k`` and ``top_p`` are off; with them on, sampling draws from the truncated renormalised
distribution while the log-prob stays the untruncated one.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import SamplingConfig

__all__ = ["GenerationCore", "GenerationOutput", "sample_tokens"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GenerationOutput:
    """One sample. ``prompt_position`` is the index of its prompt in the call's prompt list."""

    prompt_position: int
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str  # "stop": a stop token was sampled (and is the last token); "length": max_new_tokens


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; returns (tokens [B] int64, log-probs [B] float32)."""
    logits = logits.float()
    if sampling.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logp
    scaled = logits / sampling.temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    masked = scaled
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        masked = masked.masked_fill(drop, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logp_all.gather(-1, tokens[:, None])[:, 0]


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class GenerationCore:
    """Loads a causal LM from ``model_path`` and generates for batches of token-id prompts."""

    def __init__(
        self, model_path: str | Path, device: str | torch.device = "cpu", dtype: str = "float32"
    ) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_path))
        self.model: Any = model.to(device=self.device, dtype=_DTYPES[dtype]).eval().requires_grad_(False)
        _own_storage(self.model)
        config = self.model.config
        gen_config = getattr(self.model, "generation_config", None)
        eos = _as_list(getattr(gen_config, "eos_token_id", None)) or _as_list(
            getattr(config, "eos_token_id", None)
        )
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        pad = getattr(gen_config, "pad_token_id", None)
        if pad is None:
            pad = getattr(config, "pad_token_id", None)
        self.pad_token_id: int = int(pad) if pad is not None else (eos[0] if eos else 0)
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        # transformers 5.x renamed the forward argument ``past_key_values`` to ``cache``.
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    # -- validation ------------------------------------------------------------------------------
    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise ValueError("generate needs at least one prompt; got an empty list")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. <bos>)")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
                )
            if self.max_positions is not None and len(prompt) + max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i} is too long: {len(prompt)} tokens + max_new_tokens {max_new_tokens} > the "
                    f"model's max_position_embeddings {self.max_positions}; shorten the prompt or lower "
                    "max_new_tokens"
                )

    # -- generation ------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int | None = None,
        step_guard: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> list[GenerationOutput]:
        """``n_samples_per_prompt`` samples per prompt, consecutive, in prompt order.

        The same prompts, sampling and seed give the same tokens. ``step_guard`` wraps every forward
        pass (the engine uses it to pause between decode steps and to keep weight loads out of them).
        """
        self.check_prompts(prompts, sampling.max_new_tokens)
        guard = step_guard or contextlib.nullcontext
        n = sampling.n_samples_per_prompt
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        batch = len(rows)
        width = max(len(r) for r in rows)
        dev = self.device
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generator = torch.Generator(device=dev)
        generator.manual_seed(int(sampling.seed if seed is None else seed) & 0x7FFF_FFFF_FFFF_FFFF)
        stop_ids = torch.tensor(
            sorted({*(() if sampling.ignore_eos else self.eos_token_ids), *sampling.stop_token_ids}),
            dtype=torch.long,
            device=dev,
        )

        # The cache object is filled in place by every forward pass.
        cache_arg = {self._cache_kwarg: _new_cache()}
        with guard():
            out = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache_arg
            )
        logits = out.logits[:, -1, :]
        last_pos = positions[:, -1]

        tokens_out = torch.empty((batch, sampling.max_new_tokens), dtype=torch.long, device=dev)
        logps_out = torch.empty((batch, sampling.max_new_tokens), dtype=torch.float32, device=dev)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        lengths = torch.full((batch,), sampling.max_new_tokens, dtype=torch.long, device=dev)
        for t in range(sampling.max_new_tokens):
            tokens, logp = sample_tokens(logits, sampling, generator)
            tokens = torch.where(finished, torch.full_like(tokens, self.pad_token_id), tokens)
            tokens_out[:, t] = tokens
            logps_out[:, t] = logp
            hit = ~finished & torch.isin(tokens, stop_ids)
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            finished = finished | hit
            if t + 1 == sampling.max_new_tokens or bool(finished.all()):
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            with guard():
                out = self.model(
                    input_ids=tokens[:, None],
                    attention_mask=mask,
                    position_ids=last_pos[:, None],
                    use_cache=True,
                    **cache_arg,
                )
            logits = out.logits[:, -1, :]

        tokens_cpu, logps_cpu = tokens_out.cpu(), logps_out.cpu()
        stopped = finished.cpu()
        results = []
        for i in range(batch):
            length = int(lengths[i])
            results.append(
                GenerationOutput(
                    prompt_position=i // n,
                    token_ids=tuple(tokens_cpu[i, :length].tolist()),
                    log_probs=tuple(logps_cpu[i, :length].tolist()),
                    finish_reason="stop" if bool(stopped[i]) else "length",
                )
            )
        return results

    # -- weights -----------------------------------------------------------------------------------
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and persistent buffers in Hugging Face names."""
        return list(self.model.state_dict().items())

    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]] | Any) -> None:
        params = dict(self.model.state_dict())
        for name, tensor in named:
            if name not in params:
                raise ValueError(f"weight {name!r} is not a tensor of this model")
            params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))


def _own_storage(model: torch.nn.Module) -> None:
    """Give every tensor its own resizable storage.

    On CPU, ``from_pretrained`` leaves tensors backed by the memory-mapped safetensors file; memory
    backends cannot release such storage, and a weight update must not write into the file mapping.
    """
    for module in model.modules():
        for _, param in module.named_parameters(recurse=False):
            param.data = param.data.clone()
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                module._buffers[name] = buf.clone()


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()
