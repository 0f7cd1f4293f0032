"""What the stand-in SGLang server reports of its configuration, as SGLang 0.5.17 reports it.

``GET /server_info`` answers every ``ServerArgs`` field (0.5.17 ``entrypoints/http_server.py``
``server_info``: ``dataclasses.asdict(server_args)`` with the control-plane updates on top,
``scheduler_info``, ``startup_time``, ``internal_states``, ``version``, ``kv_events``): about 460 keys, nearly
all of them GPU configuration (CUDA graphs, kernels, speculative decoding, disaggregation) that the
stand-in does not have. :meth:`StandinArgs.server_info` answers the ones the stand-in holds: the flags it
takes, the resolved values its own behaviour follows (a radix cache of pages of one token, 8192-token
prefill chunks) and the state it keeps; the replay checks exactly these
(``tests/fixtures/sglang-0.5.17/server_info_keys.txt``).

``GET /model_info`` carries ``embedding``, the resolved embedding plan of the served model
(``configs/embedding_model_spec.py`` ``resolved_embedding_plan``); the stand-in serves causal LMs only,
whose spec is ``resolve_embedding_model_spec``'s ``"none"`` one.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["CHUNKED_PREFILL_SIZE", "StandinArgs", "embedding_plan", "prefill_graph_batch_sizes"]

# 0.5.17 server_args.py _handle_gpu_memory_settings: 8192 on a GPU of 80 GB or more at TP < 4 (an H100's)
CHUNKED_PREFILL_SIZE = 8192


def prefill_graph_batch_sizes(max_bs: int) -> list[int]:
    """The breakable prefill CUDA graph's capture sizes (0.5.17 server_args.py
    ``_generate_prefill_cuda_graph_batch_sizes``); its ``max_bs`` is the chunked prefill size
    (``_parse_cuda_graph_config``, no MLA, no ``--max-total-tokens``)."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_bs + 1, 512))
    )
    return [s for s in sizes if s <= max_bs]


def embedding_plan(args: StandinArgs) -> dict[str, Any]:
    """``resolved_embedding_plan`` of the ``"none"`` spec (a causal LM served for generation), with the
    stand-in's cache and prefill settings (0.5.17 ``configs/embedding_model_spec.py``)."""
    spec = {
        "family": "none",
        "task": "none",
        "execution": "none",
        "attention": "none",
        "pooling": "model_defined",
        "normalize": False,
        "postprocessor": "none",
        "tokenizer_special_tokens": "model_default",
        "supports_dimensions": False,
        "supports_token_embeddings": False,
        "supports_multimodal": False,
        "requires_embedding_flag": False,
        "auto_enable_embedding": False,
        "bcg_eligibility": "disabled",
        "safe_disable_kv_cache": False,
        "safe_disable_radix_cache": False,
        "safe_disable_chunked_prefill": False,
    }
    return {
        **spec,
        "enabled": args.is_embedding,
        "supports_dimensions": False,  # model_config.is_matryoshka
        "matryoshka_dimensions": [],
        "bcg": {
            "prefill_backend": "breakable",
            "enabled": True,
            "capture_token_budget": args.chunked_prefill_size,
            "capture_batch_sizes": prefill_graph_batch_sizes(args.chunked_prefill_size),
        },
        "cache": {
            "kv_cache_disabled": False,  # prefill_only_disable_kv_cache
            "radix_cache_disabled": args.disable_radix_cache,
            "chunked_prefill_disabled": args.chunked_prefill_size == -1,
        },
    }


@dataclass(frozen=True)
class StandinArgs:
    """The server arguments the stand-in holds, under ``ServerArgs``' field names and with its
    resolved defaults (0.5.17 ``server_args.py``)."""

    model_path: str
    host: str
    port: int
    tp_size: int
    base_gpu_id: int
    random_seed: int
    skip_server_warmup: bool
    enable_memory_saver: bool
    enable_weights_cpu_backup: bool
    enable_lora: bool | None
    max_lora_rank: int | None
    lora_target_modules: list[str] | None
    weight_version: str
    context_length: int | None
    device: str
    dp_size: int = 1
    pp_size: int = 1
    is_embedding: bool = False
    skip_tokenizer_init: bool = False
    page_size: int = 1
    disable_radix_cache: bool = False
    chunked_prefill_size: int = CHUNKED_PREFILL_SIZE
    max_loras_per_batch: int = 8

    @classmethod
    def parsed(cls, args: argparse.Namespace, device: str) -> StandinArgs:
        lora = bool(args.enable_lora)
        return cls(
            model_path=args.model_path,
            host=args.host,
            port=args.port,
            tp_size=args.tp_size,
            base_gpu_id=args.base_gpu_id,
            # __post_init__: a random seed when none is given
            random_seed=random.randint(0, 1 << 30) if args.random_seed is None else args.random_seed,
            skip_server_warmup=args.skip_server_warmup,
            enable_memory_saver=args.enable_memory_saver,
            enable_weights_cpu_backup=args.enable_weights_cpu_backup,
            enable_lora=True if lora else None,
            max_lora_rank=args.max_lora_rank,
            # check_lora_server_args keeps them as a list made from a set
            lora_target_modules=list(set(args.lora_target_modules)) if args.lora_target_modules else None,
            weight_version=args.weight_version,
            context_length=args.context_length,
            device=device,
        )

    def server_info(self, version: str) -> dict[str, Any]:
        """``/server_info`` as far as the stand-in has it; the server adds what changes (the weight
        version in effect, the TP size its ranks report)."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,  # ServerArgs: tokenizer_path defaults to model_path
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "context_length": self.context_length,
            "is_embedding": self.is_embedding,
            "chunked_prefill_size": self.chunked_prefill_size,
            "page_size": self.page_size,
            "disable_radix_cache": self.disable_radix_cache,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "pp_size": self.pp_size,
            "device": self.device,
            "base_gpu_id": self.base_gpu_id,
            "random_seed": self.random_seed,
            "host": self.host,
            "port": self.port,
            "skip_server_warmup": self.skip_server_warmup,
            "served_model_name": self.model_path,  # ServerArgs: defaults to model_path
            "weight_version": self.weight_version,
            "enable_lora": self.enable_lora,
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": self.lora_target_modules,
            "lora_paths": [] if self.enable_lora else None,  # check_lora_server_args
            "max_loras_per_batch": self.max_loras_per_batch,
            "enable_memory_saver": self.enable_memory_saver,
            "enable_weights_cpu_backup": self.enable_weights_cpu_backup,
            "status": "ready",  # scheduler_info (scheduler.py): the scheduler is up
            "version": version,
            "kv_events": None,  # describe_kv_events_publisher: no publisher configured
        }
