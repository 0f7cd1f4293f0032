"""vLLM adapter, the process: launch vLLM's OpenAI server as a subprocess, wait for it (bounded), stop it.

Nothing here imports vllm: the server runs on a Python of its own (``rollout.vllm.python``, typically a
virtual environment holding vLLM and its own torch). Its command is
``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1`` (the pause, cache,
``/collective_rpc`` and sleep routes are served only then) and this project's weight-sync package put on
its ``PYTHONPATH`` (:func:`extension_path`), whose worker extension
(:mod:`ppo_weight_sync.vllm_worker`) joins the weight group. Every flag :meth:`VLLMServerSpec.argv`
writes is one vLLM 0.32.0 defines (``vllm/engine/arg_utils.py`` ``EngineArgs``,
``vllm/entrypoints/openai/cli_args.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ppo_weight_sync
from ppo_weight_sync.vllm_worker import EXTENSION

from .server_process import ServerProcess

__all__ = [
    "CPU_HEAD_SIZES",
    "VLLMError",
    "VLLMServer",
    "VLLMServerSpec",
    "check_cpu_head_size",
    "cpu_head_size_problem",
    "extension_path",
]

# The attention head sizes vLLM's CPU attention runs (vLLM 0.32.0, vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes); any other fails the server's start, after the model loaded.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMError(RuntimeError):
    """A vLLM server failed to start, refused a request, or answered something unexpected."""


def extension_path() -> Path:
    """A folder holding only this process's ``ppo_weight_sync`` package (a link to it), for the server's
    ``PYTHONPATH``: the worker extension then runs the same code as the sender, and vLLM's environment
    needs no install of ours (the package imports torch and the standard library only)."""
    package = Path(ppo_weight_sync.__file__).resolve().parent
    folder = Path(tempfile.gettempdir()) / f"ppo-vllm-path-{os.getuid()}-{ppo_weight_sync.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "ppo_weight_sync"
    if not (link.is_symlink() and link.resolve() == package):
        staged = folder / f".link-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        staged.symlink_to(package, target_is_directory=True)
        staged.replace(link)  # atomic: a server starting meanwhile sees the old link or the new one
    return folder


def cpu_head_size_problem(model_config: Mapping[str, Any], where: str) -> str | None:
    """The one-line refusal of a model (its Hugging Face ``config.json``, parsed) whose attention head
    size vLLM's CPU attention cannot run; None when it can, or when the config names no head size (or
    is an MLA model's, whose head vLLM sizes otherwise). The head size is ``head_dim``, else
    ``hidden_size / num_attention_heads``, of ``text_config`` in a multimodal config: vLLM 0.32.0's
    reading (``vllm/transformers_utils/model_arch_config_convertor.py``, ``get_head_size``)."""
    text = model_config.get("text_config")
    cfg = text if isinstance(text, Mapping) else model_config
    if "kv_lora_rank" in cfg:
        return None
    head, hidden, heads = cfg.get("head_dim"), cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if isinstance(head, int) and head > 0:
        size, why = head, "head_dim"
    elif isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        size, why = hidden // heads, f"hidden_size {hidden} / num_attention_heads {heads}"
    else:
        return None
    if size in CPU_HEAD_SIZES:
        return None
    return (
        f"rollout.engine='vllm' on CPU takes attention head sizes {list(CPU_HEAD_SIZES)}; {where} has "
        f"{size} ({why}): run vLLM on GPUs (placement.device='cuda'), or use rollout.engine='builtin'"
    )


def check_cpu_head_size(model_path: str) -> None:
    """Refuse, before a CPU server starts, a model folder whose head size vLLM's CPU attention cannot run
    (:func:`cpu_head_size_problem`; a path without ``config.json``, e.g. a hub id, is left to vLLM)."""
    config_json = Path(model_path).expanduser() / "config.json"
    try:
        parsed = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(parsed, dict):
        return
    problem = cpu_head_size_problem(parsed, f"the model at {model_path}")
    if problem is not None:
        raise ValueError(problem)


@dataclass(frozen=True)
class VLLMServerSpec:
    """The arguments of one server. The flags, and why:

    - ``--dtype``: the dtype the actor sends its weights in (vLLM's ``auto`` would serve a float32
      checkpoint in bfloat16 on CPU and float16 on older GPUs; the updates would be rounded on load).
    - ``--seed``: the server's default seed (every request here carries its own).
    - ``--worker-extension-cls``: the weight-sync extension (:mod:`ppo_weight_sync.vllm_worker`).
    - ``--logprobs-mode processed_logprobs``: each token's log-prob after temperature (and top-k/top-p,
      which renormalise over the tokens they keep), as the trainer recomputes it; vLLM's default
      (``raw_logprobs``) ignores the temperature.
    - ``--max-model-len``: the prompt's and the response's tokens together, when the config bounds them.
    - ``--enforce-eager``: no ``torch.compile`` of the model at start (``eager``): on CPU it costs minutes
      of a 2-core machine for a model of a few layers.
    - ``--tensor-parallel-size``: the engine's GPUs (1 on CPU).
    """

    model_path: str
    port: int
    python: str
    dtype: str = "float32"
    host: str = "127.0.0.1"
    seed: int = 0
    tp_size: int = 1
    max_model_len: int | None = None
    eager: bool = True
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # added to the server's environment

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.python:
            raise ValueError("python must name the Python vLLM is installed for (rollout.vllm.python)")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path]
        args += ["--host", self.host, "--port", str(self.port), "--seed", str(self.seed)]
        args += ["--tensor-parallel-size", str(self.tp_size), "--worker-extension-cls", EXTENSION]
        if "--dtype" not in self.extra_args:
            args += ["--dtype", self.dtype]
        if "--logprobs-mode" not in self.extra_args:
            args += ["--logprobs-mode", "processed_logprobs"]
        if self.max_model_len is not None and "--max-model-len" not in self.extra_args:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.eager and "--enforce-eager" not in self.extra_args:
            args.append("--enforce-eager")
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(extension_path()), *filter(None, [env.get("PYTHONPATH", "")])]
        env.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=os.pathsep.join(paths))
        env.update(self.env)
        return env


class VLLMServer(ServerProcess):
    """One vLLM server subprocess in its own process group. ``start()`` returns once ``/health`` answers
    200 (:class:`~ppo_rollout.engine.server_process.ServerProcess`)."""

    KIND = "vLLM server"
    ERROR = VLLMError
    STARTUP_SETTING = "rollout.vllm.startup_timeout_s"

    def __init__(
        self,
        spec: VLLMServerSpec,
        *,
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 15.0,
        log_path: str | Path | None = None,
        name: str = "",
    ) -> None:
        super().__init__(
            spec.url,
            startup_timeout_s=startup_timeout_s,
            stop_grace_s=stop_grace_s,
            log_path=log_path,
            name=name or f"vllm@{spec.url}",
            log_prefix="vllm-",
        )
        self.spec = spec

    def argv(self) -> Sequence[str]:
        return self.spec.argv()

    def environment(self) -> Mapping[str, str]:
        return self.spec.environment()
