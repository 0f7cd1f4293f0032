"""The vLLM side of a weight update: a worker extension vLLM's workers load (``--worker-extension-cls``).

A vLLM server started with ``--worker-extension-cls ppo_weight_sync.vllm_worker.WeightSyncExtension``
mixes :class:`WeightSyncExtension` into each of its workers; the methods are then reachable over
``POST /collective_rpc`` (served with ``VLLM_SERVER_DEV_MODE=1``), each taking one JSON string and
answering a JSON object. The worker joins the project's weight group through a
:class:`~ppo_weight_sync.WeightReceiver` (gloo on CPU, NCCL on GPUs), so the trainer's
:class:`~ppo_weight_sync.WeightSender` updates a vLLM server exactly as it updates SGLang or the
built-in engine (the HTTP side is :mod:`ppo_weight_sync.vllm_endpoint`).

The tensors of one update are kept (copies, in Hugging Face names) until its last call (the one with
``flush_cache``, as every transport marks it), then handed to vLLM's ``Worker.reload_weights`` at once:
vLLM's layer-wise reload (``vllm/model_executor/model_loader/reload/layerwise.py``) processes a layer
only once all its tensors are loaded, and its CPU backend repacks each linear layer's weight for its
kernels after loading (``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm``), so a
plain ``model.load_weights`` would leave the kernels on the old weights.

:meth:`WeightSyncExtension.ppo_weights_checksum` reads the weights back in Hugging Face names for
``train.check_weights``: fused parameters (``qkv_proj``, ``gate_up_proj``, from the model's
``packed_modules_mapping``) are cut back into their parts, padded vocabularies cut to the model's, and a
linear layer whose weight vLLM's CPU backend moved into its kernel (an empty parameter) is read through
that kernel, one identity matrix through ``cpu_linear``: what generation computes with.

Imports the standard library, torch and this package only (vLLM's own modules inside the methods), so
that vLLM's environment needs nothing else: the adapter puts this package on the server's
``PYTHONPATH``. The worker also keeps each update's weight version
(:meth:`WeightSyncExtension.ppo_weight_version`) for vLLM 0.26.0, whose server has no weight-version
route. Followed from vLLM 0.32.0's source (the same in 0.26.0): ``vllm/v1/worker/worker_base.py``
(the extension's methods must not clash with the worker's), ``vllm/v1/worker/gpu_worker.py``
(``reload_weights``, ``get_model``), ``vllm/entrypoints/serve/dev/rpc/api_router.py``
(``/collective_rpc``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from ppo_weight_sync.buckets import dtype_from_name
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.receiver import WeightReceiver
from ppo_weight_sync.requests import (
    DestroyRequest,
    InitRequest,
    TensorRequest,
    UpdateRequest,
    ValidationError,
)
from ppo_weight_sync.sglang_weights import rows_checksum

__all__ = ["EXTENSION", "Manifest", "WeightSyncExtension", "read_hf_tensor"]

EXTENSION = "ppo_weight_sync.vllm_worker.WeightSyncExtension"

# name -> (dtype name, shape): the tensors the actor sends, as the adapter hands them over
Manifest = Mapping[str, tuple[str, tuple[int, ...]]]


def _manifest(rows: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``[[name, dtype, shape], ...]`` (JSON) as a manifest; ValueError naming what is wrong."""
    if not isinstance(rows, list) or not rows:
        raise ValueError("expected: a non-empty list of [name, dtype, shape]")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)):
            raise ValueError(f"expected: each entry [name, dtype, shape], got {str(row)[:80]}")
        out[row[0]] = (str(row[1]), tuple(int(n) for n in row[2]))
    return out


_Request = TypeVar("_Request", InitRequest, TensorRequest)


def _with_manifest(body: str, kind: type[_Request]) -> tuple[_Request, Manifest, float]:
    """A request that carries the model's manifest: ``kind``'s fields plus ``expected`` (``[[name, dtype,
    shape], ...]``) and ``timeout_s`` (every receive's bound, 300 s when absent)."""
    data = json.loads(body)
    return kind.parse(data), _manifest(data.get("expected")), float(data.get("timeout_s", 300.0))


class WeightSyncExtension:
    """Mixed into each vLLM worker (vLLM never calls its ``__init__``: state is made on first use).

    Every method takes one JSON string (``/collective_rpc`` passes its ``args`` as they came) and
    answers a JSON object: :class:`~ppo_weight_sync.ops.EngineReply`'s body for the weight operations.
    """

    # -- state, made on first use ------------------------------------------------------------------
    def _ppo_state(self) -> dict[str, Any]:
        state: dict[str, Any] | None = getattr(self, "_ppo_sync", None)
        if state is None:
            state = {"expected": {}, "pending": [], "receiver": None, "version": None}
            self._ppo_sync = state
        return state

    def _ppo_receiver(self, timeout_s: float) -> WeightReceiver:
        state = self._ppo_state()
        if state["receiver"] is None:
            from vllm.distributed import get_tp_group

            state["receiver"] = WeightReceiver(
                self._ppo_stage,
                self._ppo_expected,
                torch.device(getattr(self, "device", "cpu")),
                local_rank=get_tp_group().rank_in_group,
                timeout_s=timeout_s,
            )
        receiver: WeightReceiver = state["receiver"]
        return receiver

    def _ppo_expected(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        held: Manifest = self._ppo_state()["expected"]
        return {name: (dtype_from_name(dtype), shape) for name, (dtype, shape) in held.items()}

    def _ppo_stage(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The receiver reuses its buffers: keep copies until the update's last call loads them all.
        self._ppo_state()["pending"].extend((name, t.clone()) for name, t in weights)

    # -- the weight operations (each: one JSON string in, EngineReply's body out) -------------------
    def ppo_init_weights_update_group(self, body: str) -> dict[str, Any]:
        """Join the group. ``body``: the ``InitRequest``'s fields plus ``expected`` (the manifest,
        ``[[name, dtype, shape], ...]``) and ``timeout_s`` (every receive's bound)."""
        try:
            request, expected, timeout_s = _with_manifest(body, InitRequest)
        except (ValueError, ValidationError, TypeError) as exc:
            return EngineReply.refused(f"bad init_weights_update_group body: {exc}").to_json()
        self._ppo_state()["expected"] = expected
        receiver = self._ppo_receiver(timeout_s)
        receiver.timeout_s = timeout_s
        return receiver.init_weights_update_group(request).to_json()

    def ppo_update_weights_from_distributed(self, body: str) -> dict[str, Any]:
        """Receive one call's tensors; the update's last call (``flush_cache``) loads them all."""
        try:
            request = UpdateRequest.parse(json.loads(body))
        except (ValueError, ValidationError) as exc:
            return EngineReply.refused(f"bad update_weights_from_distributed body: {exc}").to_json()
        state = self._ppo_state()
        receiver = state["receiver"]
        if receiver is None:
            return EngineReply.refused("no weight group joined; call init_weights_update_group").to_json()
        reply: EngineReply = receiver.update_weights_from_distributed(request)
        return self._ppo_finish(reply, request.flush_cache, request.weight_version)

    def ppo_update_weights_from_tensor(self, body: str) -> dict[str, Any]:
        """One call of a colocated update (CUDA IPC from the actor rank on this GPU: no group to join).
        ``body``: the ``TensorRequest``'s fields plus ``expected`` (the manifest) and ``timeout_s``, as
        ``ppo_init_weights_update_group`` takes them; the update's last call (``flush_cache``) loads it."""
        try:
            request, expected, timeout_s = _with_manifest(body, TensorRequest)
        except (ValueError, ValidationError, TypeError) as exc:
            return EngineReply.refused(f"bad update_weights_from_tensor body: {exc}").to_json()
        self._ppo_state()["expected"] = expected
        reply = self._ppo_receiver(timeout_s).update_weights_from_tensor(request)
        return self._ppo_finish(reply, request.flush_cache, request.weight_version)

    def _ppo_finish(self, reply: EngineReply, last: bool, version: str | None) -> dict[str, Any]:
        """After one call's tensors arrived (or not): the update's last call loads them all at once
        through vLLM's ``reload_weights``; a call that failed drops what the update had staged."""
        state = self._ppo_state()
        if not reply.success:
            state["pending"] = []
            return reply.to_json()
        if last:
            pending, state["pending"] = state["pending"], []
            try:
                self.reload_weights(weights_iterator=pending)  # type: ignore[attr-defined]  # vLLM's Worker
            except Exception as exc:  # the group is still in step: a refusal, nothing half-loaded kept
                return EngineReply.refused(f"vLLM could not load the weights: {exc!r}").to_json()
            reply = EngineReply.ok(f"Loaded {len(pending)} tensors into vLLM.")
        if (
            version is not None
        ):  # not the receiver's: it records one when the tensors arrive, before vLLM loads them
            state["version"] = version
        return reply.to_json()

    def ppo_weight_version(self, body: str) -> dict[str, Any]:
        """``{"weight_version": str | null}``: the version of the last update that carried one (None
        before any), for a vLLM without ``/weight_info`` (0.26.0). ``body``: ignored (``"{}"``)."""
        return {"weight_version": self._ppo_state()["version"]}

    def ppo_destroy_weights_update_group(self, body: str) -> dict[str, Any]:
        try:
            request = DestroyRequest.parse(json.loads(body))
        except (ValueError, ValidationError) as exc:
            return EngineReply.refused(f"bad destroy_weights_update_group body: {exc}").to_json()
        state = self._ppo_state()
        state["pending"] = []
        receiver = state["receiver"]
        if receiver is None:
            return EngineReply.ok("no weight group joined; nothing to destroy").to_json()
        return receiver.destroy_weights_update_group(request).to_json()

    # -- weights read back ---------------------------------------------------------------------------
    def ppo_weights_checksum(self, body: str) -> dict[str, Any]:
        """``{"manifest": [[name, dtype, shape], ...], "rows": int | null}`` -> ``{"checksum": hex}``:
        :func:`~ppo_weight_sync.sglang_weights.rows_checksum` of the weights as this worker computes
        with them, in Hugging Face names (equal to the actor's exactly when the weights are)."""
        try:
            data = json.loads(body)
            manifest = _manifest(data.get("manifest"))
            rows = data.get("rows")
        except (ValueError, TypeError) as exc:
            return {"error": f"bad weights_checksum body: {exc}"}
        model = self.get_model()  # type: ignore[attr-defined]  # vLLM's Worker
        try:
            with torch.no_grad():
                named = [
                    (name, read_hf_tensor(model, name, manifest).to(dtype_from_name(dtype)))
                    for name, (dtype, _) in manifest.items()
                ]
        except (AttributeError, ValueError) as exc:
            return {"error": f"could not read the weights back: {exc}"}
        return {"checksum": rows_checksum(named, rows)}


def read_hf_tensor(model: torch.nn.Module, name: str, manifest: Manifest) -> torch.Tensor:
    """The Hugging Face tensor ``name`` (shape from ``manifest``) as ``model`` (a vLLM model of one
    tensor-parallel rank) holds it: cut from a fused parameter, a padded vocabulary cut to size."""
    shape = manifest[name][1]
    module_path, _, leaf = name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    for fused, parts in packed.items():
        if module_name in parts:
            full = _module_tensor(model, f"{parent}.{fused}" if parent else fused, leaf)
            siblings = [f"{parent}.{p}.{leaf}" if parent else f"{p}.{leaf}" for p in parts]
            index = list(parts).index(module_name)
            offset = sum(manifest[s][1][0] for s in siblings[:index] if s in manifest)
            return _cut(full[offset:], shape, name)
    return _cut(_module_tensor(model, module_path, leaf), shape, name)


def _module_tensor(model: torch.nn.Module, module_path: str, leaf: str) -> torch.Tensor:
    module = model.get_submodule(module_path)
    tensor = getattr(module, leaf)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{module_path}.{leaf} is not a tensor")
    kernel = getattr(module, "cpu_linear", None)
    if leaf == "weight" and tensor.numel() == 0 and kernel is not None:
        # vLLM's CPU backend keeps the weight in its kernel only: x @ W.T with x = I gives W.T exactly.
        inputs = int(getattr(module, "input_size_per_partition", getattr(module, "input_size", 0)))
        eye = torch.eye(inputs, dtype=tensor.dtype, device=tensor.device)
        return torch.as_tensor(kernel(eye, tensor, None)).t().contiguous()
    return tensor.detach()


def _cut(tensor: torch.Tensor, shape: Sequence[int], name: str) -> torch.Tensor:
    if tensor.dim() != len(shape) or any(have < want for have, want in zip(tensor.shape, shape, strict=True)):
        raise ValueError(f"{name}: vLLM holds shape {list(tensor.shape)}, the model has {list(shape)}")
    return tensor[tuple(slice(0, n) for n in shape)].contiguous()
