"""Every route and payload the SGLang adapter uses, driven through the adapter itself, step by step.

Used by ``benchmarks/sglang/record.py`` (against a real server, through a
:class:`~ppo_rollout.testing.sglang_record.RecordingProxy`, to write the replay fixtures) and by the replay
test (the steps that need a live peer, a weight group or CUDA IPC, are run again against the stand-in).
Each step checks what SGLang v0.5.17 answers (``sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``, ``managers/scheduler_components/weight_updater.py``) and raises
:class:`ExerciseError` when the answer is not that. Steps run in order on one server; the state one
leaves (weights, version, memory) is what the next expects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ppo_weight_sync.sglang_weights import rows_checksum

from ..config import AdapterUpdates, SamplingConfig
from ..engine.core import GenerationOutput
from ..engine.sglang import SGLangClient, SGLangError
from .sglang_record import RecordingProxy, StepRecord

__all__ = ["LORA", "LORA_STEPS", "STEPS", "Context", "ExerciseError", "Step", "make_models", "run_steps"]

LORA = AdapterUpdates(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
PROMPTS = [[1, 5, 6, 14], [1, 7, 8, 9, 14]]
SYNC_DTYPE = torch.bfloat16  # what the actor sends; the models are saved in it, so the server holds it too
CHECK_ROWS = 3
LONG_TOKENS = 1500  # a generation that is still running when the flush arrives


class ExerciseError(AssertionError):
    """A step got an answer other than SGLang v0.5.17's."""


@dataclass
class Context:
    """What the steps share: the client (its URL is the proxy's), the proxy, the models, the weight
    group's backend and the device its tensors are on (``nccl`` from a second GPU; ``gloo`` from the CPU,
    which a server on the one GPU also takes: NCCL cannot put two ranks on one GPU), and the server's GPU
    (the CUDA IPC step's; None: that step is not run)."""

    client: SGLangClient
    proxy: RecordingProxy
    model: Path
    other: Path
    backend: str = "gloo"
    sender_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device: torch.device | None = None
    held: Path | None = None  # the model whose weights the server holds now

    def named(self, model: Path, where: torch.device | None = None) -> list[tuple[str, torch.Tensor]]:
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(model, dtype=SYNC_DTYPE).state_dict()
        to = self.sender_device if where is None else where
        return [(n, t.to(SYNC_DTYPE).to(to).contiguous()) for n, t in state.items()]


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise ExerciseError(what)


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Context], None]
    compare: dict[str, Any] = field(default_factory=dict)  # StepRecord's exact/loose/subset/needs


STEPS: list[Step] = []
LORA_STEPS: list[Step] = []


def step(
    name: str, into: list[Step] | None = None, **compare: Any
) -> Callable[[Callable[[Context], None]], Any]:
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        (STEPS if into is None else into).append(Step(name, fn, compare))
        return fn

    return register


def _sampling(**kw: Any) -> SamplingConfig:
    base: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "max_new_tokens": 6}
    return SamplingConfig(**{**base, **kw})


# -- the server's own routes --------------------------------------------------------------------------
@step("health")
def _health(ctx: Context) -> None:
    expect(ctx.client.health(), "GET /health did not answer 200")


@step("server_info", subset={"/server_info": ["version", "tp_size", "dp_size", "pp_size"]})
def _server_info(ctx: Context) -> None:
    client = SGLangClient(ctx.proxy.url, timeout_s=ctx.client.timeout_s, name="probe")
    try:
        expect(client.protocol.version == ctx.client.protocol.version, "the version changed")
    finally:
        client.close()


@step("model_info")
def _model_info(ctx: Context) -> None:
    body = ctx.client.endpoint.request("GET", "/model_info")
    expect(isinstance(body, dict) and "weight_version" in body, f"/model_info lacks weight_version: {body}")
    expect(body.get("is_generation") is True, f"/model_info is_generation: {body.get('is_generation')}")


# -- generation ---------------------------------------------------------------------------------------
def _check_outputs(outs: Sequence[GenerationOutput], n: int, tokens: int | None) -> None:
    expect(len(outs) == n, f"{len(outs)} results for {n} requests")
    for o in outs:
        expect(len(o.token_ids) == len(o.log_probs) > 0, f"tokens and log-probs differ: {o}")
        expect(all(lp <= 0.0 for lp in o.log_probs), f"a log-prob above 0: {o.log_probs}")
        if tokens is not None:
            expect(len(o.token_ids) == tokens and o.finish_reason == "length", f"not {tokens} tokens: {o}")


@step("generate")
def _generate(ctx: Context) -> None:
    sampling = _sampling(n_samples_per_prompt=2, ignore_eos=True, seed=3)
    outs = ctx.client.generate(PROMPTS, sampling)
    _check_outputs(outs, 4, 6)
    expect(
        ctx.client.generate(PROMPTS, sampling) == outs, "seeded sampling drew other tokens the second time"
    )


@step("generate_limits", exact=["*.meta_info.completion_tokens"])
def _generate_limits(ctx: Context) -> None:
    outs = ctx.client.generate(PROMPTS, _sampling(ignore_eos=True), max_new_tokens=[2, 5])
    expect([len(o.token_ids) for o in outs] == [2, 5], f"per-prompt limits not honoured: {outs}")


@step(
    "generate_stop",
    loose=[
        "*.meta_info.finish_reason",
        "*.meta_info.completion_tokens",
        "*.meta_info.output_token_logprobs",
        "*.output_ids",
    ],
)
def _generate_stop(ctx: Context) -> None:
    # which stop ends each request depends on the model's numbers: only the shapes are compared
    sampling = _sampling(max_new_tokens=8, stop_token_ids=(14,))
    outs = ctx.client.generate(PROMPTS, sampling, stop=[["1", "2"], ["3"]])
    _check_outputs(outs, 2, None)
    expect(all(o.finish_reason in ("stop", "length") for o in outs), f"finish reasons: {outs}")


@step("generate_unknown_token", exact=["error.message"])
def _generate_bad(ctx: Context) -> None:
    """A token id outside the vocabulary is refused by the client, never sent: a real 0.5.17 server
    fails a device-side assert on it and dies (seen on an H100), so this step records no exchange."""
    try:
        ctx.client.generate([[1, 10**7]], _sampling(max_new_tokens=2))
    except ValueError as exc:
        expect("outside the model's vocabulary" in str(exc), f"not the client's refusal: {exc}")
        return
    raise ExerciseError("a token id outside the vocabulary was sent to the server")


# -- generation control -------------------------------------------------------------------------------
@step("pause_continue", exact=["message"])
def _pause_continue(ctx: Context) -> None:
    ep = ctx.client.endpoint
    expect(ep.pause_generation().result(60).success, "pause_generation failed")
    expect(ep.continue_generation().result(60).success, "continue_generation failed")


@step("flush_cache")
def _flush(ctx: Context) -> None:
    expect(ctx.client.endpoint.flush_cache().result(60).success, "flush_cache on an idle server failed")


def _in_background(fn: Callable[[], Any]) -> Callable[[float], Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait(timeout_s: float) -> Any:
        thread.join(timeout_s)
        expect(not thread.is_alive(), f"the background call did not finish within {timeout_s:.0f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return wait


@step("flush_while_running")
def _flush_while_running(ctx: Context) -> None:
    wait = _in_background(
        lambda: ctx.client.generate(PROMPTS[:1], _sampling(max_new_tokens=LONG_TOKENS, ignore_eos=True))
    )
    time.sleep(0.5)
    reply = ctx.client.endpoint.call("POST", "/flush_cache")  # once: the endpoint's flush retries
    expect(not reply.success, "a flush while a request runs succeeded (SGLang refuses it: 400)")
    _check_outputs(wait(600), 1, LONG_TOKENS)


# -- weights ------------------------------------------------------------------------------------------
def _push(ctx: Context, model: Path, version: str, where: torch.device | None = None, **sender: Any) -> None:
    from ppo_weight_sync import WeightSender

    ws = WeightSender(backend=ctx.backend, master_address="127.0.0.1", timeout_s=300, **sender)
    ws.connect([ctx.client.endpoint])
    try:
        ws.update(ctx.named(model, where), version=version)
    finally:
        ws.disconnect()
    got = ctx.client.endpoint.get_weight_version().result(60)
    expect(got == version, f"weight version {got!r} after the update, expected {version!r}")
    ctx.held = model


def _check_held(ctx: Context, model: Path, rows: int | None = CHECK_ROWS) -> None:
    from ppo_weight_sync.buckets import dtype_name
    from ppo_weight_sync.sglang_weights import rows_checksum

    named = ctx.named(model, torch.device("cpu"))
    manifest = [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named]
    got = ctx.client.weights_checksum(manifest, rows)
    expect(got == rows_checksum(named, rows), f"the server's weights are not {model.name}'s")


@step("update_distributed_per_tensor", needs="peer")
def _update_per_tensor(ctx: Context) -> None:
    _push(ctx, ctx.other, "dist-1", load_format="per_tensor")
    _check_held(ctx, ctx.other)


@step("update_distributed_flattened", needs="peer")
def _update_flat(ctx: Context) -> None:
    _push(ctx, ctx.model, "dist-2", load_format="flattened_bucket", bucket_bytes=64 << 10)
    _check_held(ctx, ctx.model)


@step("update_from_tensor_ipc", needs="cuda")
def _update_ipc(ctx: Context) -> None:
    from ppo_weight_sync import ColocatedIpc

    expect(ctx.device is not None, "CUDA IPC needs a GPU")
    assert ctx.device is not None
    torch.cuda.set_device(ctx.device)
    ipc = ColocatedIpc([ctx.client.endpoint.name], bucket_bytes=64 << 10, device=ctx.device)
    _push(ctx, ctx.other, "ipc-1", ctx.device, transports=[ipc])  # several buckets, one request each
    _check_held(ctx, ctx.other)


@step("get_weights_by_name")
def _weights_by_name(ctx: Context) -> None:
    expect(ctx.held is not None, "no update ran before")
    assert ctx.held is not None
    _check_held(ctx, ctx.held, rows=None)  # every row: the whole model, fused and tied names included
    body = ctx.client.endpoint.request("POST", "/get_weights_by_name", {"name": "model.norm.weight"})
    expect(isinstance(body, list), f"a 1-D weight is a list: {str(body)[:120]}")


@step("get_weights_by_name_unknown", exact=["error.message"])
def _weights_unknown(ctx: Context) -> None:
    body = ctx.client.endpoint.request("POST", "/get_weights_by_name", {"name": "model.nothing.weight"})
    expect(isinstance(body, dict) and "error" in body, f"an unknown name answered {str(body)[:120]}")


@step("update_weight_version")
def _weight_version(ctx: Context) -> None:
    body = {"new_version": "manual-1", "abort_all_requests": False}
    expect(ctx.client.endpoint.call("POST", "/update_weight_version", body).success, "refused")
    expect(ctx.client.endpoint.get_weight_version().result(60) == "manual-1", "version not set")


@step("malformed_update")
def _malformed(ctx: Context) -> None:
    ep = ctx.client.endpoint
    bad = ep.call("POST", "/update_weights_from_distributed", {"names": "not-a-list"})
    expect(not bad.success, "a malformed update_weights_from_distributed was accepted")
    bad = ep.call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]})
    expect(not bad.success, "a malformed update_weights_from_tensor was accepted")
    expect(ctx.client.health(), "the server died of a malformed update")


# -- memory -------------------------------------------------------------------------------------------
@step("release_resume_tags")
def _release_resume(ctx: Context) -> None:
    c = ctx.client
    expect(c.release_memory_occupation(tags=["kv_cache"]).success, "release kv_cache failed")
    expect(c.release_memory_occupation(tags=None).success, "release of the other tags failed")
    expect(c.resume_memory_occupation(tags=["weights"]).success, "resume weights failed")
    expect(c.resume_memory_occupation(tags=None).success, "resume of the other tags failed")
    _check_outputs(c.generate(PROMPTS[:1], _sampling(ignore_eos=True)), 1, 6)


@step("release_while_paused")
def _release_paused(ctx: Context) -> None:
    c = ctx.client
    expect(c.endpoint.pause_generation().result(60).success, "pause failed")
    expect(c.release_memory_occupation(tags=None).success, "release while paused failed")


@step("generate_while_released")
def _generate_released(ctx: Context) -> None:
    """Generation stays paused while memory is released: the request waits, then runs after the resume.
    The released weights come back as zeros (0.5.17 keeps no copy without --enable-weights-cpu-backup;
    seen on an H100): whole weights must follow a resume, as the training loop sends them."""
    wait = _in_background(lambda: ctx.client.generate(PROMPTS[:1], _sampling(ignore_eos=True)))
    time.sleep(1.0)
    expect(ctx.client.resume_memory_occupation(tags=None).success, "resume failed")
    _check_outputs(wait(300), 1, 6)
    held = ctx.held or ctx.model
    named = [(n, torch.zeros_like(t)) for n, t in ctx.named(held, torch.device("cpu"))]
    got = ctx.client.weights_checksum([(n, "bfloat16", tuple(t.shape)) for n, t in named], CHECK_ROWS)
    expect(got == rows_checksum(named, CHECK_ROWS), "the released weights did not come back as zeros")


# -- LoRA (a server launched with --enable-lora) -------------------------------------------------------
def _adapters(model: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(cfg.num_hidden_layers):
        for module in LORA.target_modules:
            path = f"model.layers.{layer}.self_attn.{module}"
            out_dim = (
                cfg.hidden_size
                if module == "q_proj"
                else cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
            )
            a = torch.randn(LORA.rank, cfg.hidden_size, generator=gen) * 0.1
            b = torch.randn(out_dim, LORA.rank, generator=gen) * 0.1
            out += [(f"{path}.lora_A.weight", a.to(SYNC_DTYPE)), (f"{path}.lora_B.weight", b.to(SYNC_DTYPE))]
    return out


@step("lora_unknown_adapter", into=LORA_STEPS, exact=["error.message"])
def _lora_unknown(ctx: Context) -> None:
    named = SGLangClient(ctx.proxy.url, timeout_s=60, name="lora-probe", adapter="no_such_adapter")
    try:
        named.generate(PROMPTS[:1], _sampling())
    except SGLangError as exc:
        expect("refused /generate" in str(exc), f"not a refusal: {exc}")
        return
    finally:
        named.close()
    raise ExerciseError("a generate naming an adapter never loaded was accepted")


@step("lora_load_from_tensors", into=LORA_STEPS, needs="peer", loose=["loaded_adapters"])
def _lora_load(ctx: Context) -> None:
    from ppo_weight_sync import WeightSender
    from ppo_weight_sync.sglang_lora import ADAPTER_NAME, SGLangAdapters

    ws = WeightSender(timeout_s=120, transports=[SGLangAdapters(LORA.alpha)])
    ws.connect([ctx.client.endpoint])
    try:
        for version, seed in (("lora-1", 1), ("lora-2", 2)):  # the second unloads the first
            ws.update(_adapters(ctx.model, seed), version=version)
            got = ctx.client.endpoint.get_weight_version().result(60)
            expect(got == version, f"weight version {got!r}, expected {version!r}")
    finally:
        ws.disconnect()
    named = SGLangClient(ctx.proxy.url, timeout_s=60, name="lora", adapter=ADAPTER_NAME)
    try:
        _check_outputs(named.generate(PROMPTS, _sampling(ignore_eos=True)), 2, 6)
    finally:
        named.close()


def run_steps(
    ctx: Context, steps: Sequence[Step], only: Callable[[Step], bool] = lambda s: True
) -> Iterator[tuple[Step, StepRecord, BaseException | None]]:
    """Runs each step under its own label on the proxy; yields it, its record and its failure (None: it
    passed). A failure does not stop the steps after it."""
    for s in steps:
        if not only(s):
            continue
        with ctx.proxy.step(s.name, **s.compare) as record:
            error: BaseException | None = None
            try:
                s.run(ctx)
            except Exception as exc:  # every failure is reported by the caller, by step
                error = exc
        yield s, record, error


def make_models(folder: Path, *, max_positions: int = 2048) -> tuple[Path, Path]:
    """Two tiny Llama models of the copy task's character tokenizer (:func:`~ppo_rollout.tasks.
    make_tiny_model`, seeds 0 and 1), saved in bfloat16 (so SGLang serves them in bfloat16, the dtype
    the steps send) and long enough for :data:`LONG_TOKENS`."""
    from transformers import AutoModelForCausalLM

    from ..tasks import make_tiny_model

    paths = []
    for seed in (0, 1):
        path = make_tiny_model("copy", folder / f"tiny-{seed}", seed=seed, max_positions=max_positions)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=SYNC_DTYPE)
        model.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
