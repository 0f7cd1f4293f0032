"""The rollout manager: engines, prompts, sampling, rewards, and the training batch per rank."""

from __future__ import annotations

import concurrent.futures
import contextlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ppo_lifecycle.startup import role_startup
from ppo_value_transport import Box, pack_fields
from ppo_weight_sync import EngineEndpoint
from ppo_weight_sync.sglang_lora import ADAPTER_NAME

from .batch import rank_fields, split_indices
from .config import RolloutConfig, SamplingConfig, SamplingSettings
from .data import PromptRenderer, PromptSource, open_prompts
from .dynamic_sampling import select_groups
from .engine.builtin import MEMORY_TAGS
from .engine.handles import BuiltinEngineHandle, EngineHandle, SGLangEngineHandle
from .environment import EnvironmentFactory, resolve_environment
from .generate_client import GenerateClient
from .observation import ObservationRenderer
from .overlong import shape_overlong
from .prompts import encode_texts
from .rewards import RewardInput, compute_rewards, resolve_reward
from .rollout_fns import PromptGroup, RolloutContext, resolve_rollout_function
from .rollout_metrics import multi_turn_metrics, sample_metrics
from .runner import ClientSeeds, RolloutRun, run_rollout
from .slots import EngineSlots, actor_options
from .tasks import get_task
from .trajectory import Trajectory, with_outcome

__all__ = ["RolloutBatch", "RolloutManager"]


@dataclass(frozen=True)
class RolloutBatch:
    """One step's training batch: a ``pack_fields`` Box per actor data-parallel rank, and metrics.

    ``sample_ids[r]``: the step's sample ids actor rank ``r`` holds, in its order. ``critic_boxes``
    and ``critic_sample_ids``: the same samples split over the critic's ranks (the actor's split
    when the two sizes agree); ``ppo_value_transport.pair_values`` maps the critic's values back.
    """

    boxes: list[Box]
    metrics: dict[str, float] = field(default_factory=dict)
    sample_ids: list[list[int]] = field(default_factory=list)
    critic_boxes: list[Box] = field(default_factory=list)
    critic_sample_ids: list[list[int]] = field(default_factory=list)


# The reward from which an evaluation sample counts as correct (eval/accuracy).
CORRECT_REWARD = 1.0


def _version_number(version: str | None) -> int:
    """A weight version as recorded per sample: the driver's versions are step numbers."""
    try:
        return int(version) if version is not None else -1
    except ValueError:
        return -1


def _eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The ids a turn ends on: the generation config's eos ids (what the engines stop on), else the
    tokenizer's."""
    from transformers import GenerationConfig

    ids: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return ids


def _combined(runs: Sequence[RolloutRun], trajectories: list[Trajectory]) -> RolloutRun:
    """The rounds of one step as one run: the trained trajectories, the rounds' seconds and engine
    calls summed, their idle shares weighted by seconds."""
    seconds = sum(r.seconds for r in runs)
    idle = sum(r.engine_idle_share * r.seconds for r in runs) / seconds if seconds > 0 else 0.0
    return RolloutRun(trajectories, seconds, idle, sum(r.engine_calls for r in runs))


class RolloutManager:
    """Owns ``config.num_engines`` engines on ``slots`` (``None``: anywhere on the local Ray instance)."""

    def __init__(
        self,
        config: RolloutConfig,
        slots: EngineSlots | None,
        *,
        dp_size: int,
        critic_dp_size: int | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if critic_dp_size is not None and (critic_dp_size < 1 or config.prompts_per_step % critic_dp_size):
            raise ValueError(
                f"rollout.prompts_per_step ({config.prompts_per_step}) must be a multiple of the critic's "
                f"data-parallel size ({critic_dp_size}): the samples of one prompt stay on one rank"
            )
        if config.prompts_per_step % dp_size:
            raise ValueError(
                f"rollout.prompts_per_step ({config.prompts_per_step}) must be a multiple of the "
                "data-parallel "
                f"size ({dp_size}): the samples of one prompt stay on one rank and ranks get equal shares"
            )
        per_engine = max(1, config.gpus_per_engine)
        if slots is not None and len(slots.bundle_indices) < config.num_engines * per_engine:
            raise ValueError(
                f"rollout needs {config.num_engines * per_engine} bundles ({config.num_engines} engines x "
                f"{per_engine}), the placement gave {len(slots.bundle_indices)}"
            )
        self.config = config
        self.dp_size = dp_size
        self.critic_dp_size = dp_size if critic_dp_size is None else critic_dp_size
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.source: PromptSource = open_prompts(config, config.seed)
        self.renderer = PromptRenderer(
            self.tokenizer,
            self.source.prompt_field,
            chat_template=config.chat_template,
            system_prompt=config.system_prompt,
        )
        if config.task is not None:
            reward_spec = config.reward or get_task(config.task).reward
        else:
            if config.reward is None:
                raise ValueError(
                    "rollout.reward is required with a dataset (a registered name or 'module:function')"
                )
            reward_spec = config.reward
        self.reward_fn = resolve_reward(reward_spec)
        self.reward_name = reward_spec
        self._setup_rollout_function(config)
        self.engines: list[EngineHandle] = []
        requested_at = time.time()
        try:
            for i in range(config.num_engines):
                self.engines.append(self._make_engine(i, slots))
            # Created first, waited for together: engines load in parallel.
            wait = config.sglang.startup_timeout_s + 60 if config.engine == "sglang" else config.timeout_s
            for engine in self.engines:
                engine.wait_ready(wait)
            # The engines' start-up, part by part (the slowest engine's), for the driver's table.
            self.startup = role_startup(requested_at, [e.startup(config.timeout_s) for e in self.engines])
        except BaseException:
            self.shutdown()
            raise
        self._offloaded = False
        self._memory_seen: dict[str, dict[str, float]] = {}  # each engine's totals at the last pop_metrics

    # -- engines -----------------------------------------------------------------------------------
    def _make_engine(self, i: int, slots: EngineSlots | None) -> EngineHandle:
        cfg = self.config
        per_engine = max(1, cfg.gpus_per_engine)
        share = float(slots.gpu_share) if slots is not None else (1.0 if cfg.device == "cuda" else 0.0)
        name = f"rollout-{i}"
        if cfg.engine == "builtin":
            return BuiltinEngineHandle(
                name,
                cfg.model_path,
                cfg.device,
                cfg.dtype,
                cfg.gpus_per_engine,
                actor_options(slots, i * per_engine, share),
                cfg.timeout_s,
                lora=cfg.lora,
            )
        gpu_ids = tuple(slots.gpu_ids) if slots is not None else ()
        base_gpu = gpu_ids[i * per_engine] if gpu_ids else i * per_engine
        spec_args = {
            "model_path": cfg.model_path,
            "port": None,
            "tp_size": cfg.gpus_per_engine,
            "base_gpu_id": base_gpu,
            "host": cfg.sglang.host,
            # Sharing GPUs with training (a fractional share) means the server must release its memory.
            "enable_memory_saver": slots is not None and 0.0 < share < 1.0,
            # rollout.sglang.mem_fraction_static; unset and sharing GPUs with training, 0.6 leaves room
            # for the trainers' CUDA contexts and what they keep resident while asleep (SGLang's own
            # default assumes the GPU is the server's alone). extra_args' --mem-fraction-static wins.
            "mem_fraction_static": cfg.sglang.mem_fraction_static
            or (0.6 if slots is not None and 0.0 < share < 1.0 else None),
            "random_seed": cfg.seed + i,
            "extra_args": cfg.sglang.extra_args,
            "lora": cfg.lora,  # adapter-only updates: the server runs with LoRA on
            **({"command": cfg.sglang.command} if cfg.sglang.command else {}),
        }
        # The launching actor holds no GPU: the server takes its GPUs by id.
        return SGLangEngineHandle(
            name,
            spec_args,
            actor_options(slots, i * per_engine, 0.0),
            startup_timeout_s=cfg.sglang.startup_timeout_s,
            stop_grace_s=cfg.sglang.stop_grace_s,
            request_timeout_s=cfg.sglang.request_timeout_s,
            adapter=ADAPTER_NAME if cfg.lora is not None else None,
        )

    def start_warm_up(self) -> Callable[[float], dict[str, float]]:
        """Start each built-in engine's ``warm_up`` for the first wave of a training step (the rows
        ``GenerateClient`` sends each engine: ``prompts_per_step`` split in near-equal contiguous
        chunks, ``n_samples_per_prompt`` rows each) and return what waits for them: the slowest
        engine's ``{"warm_up_s": ...}``. SGLang servers capture their graphs at launch: nothing to do."""
        cfg = self.config
        engines = len(self.engines)
        bounds = [round(k * cfg.prompts_per_step / engines) for k in range(engines + 1)]
        sampling = SamplingConfig.of(cfg.sampling, seed=0)
        waits = [
            engine.submit_warm_up(
                (bounds[j + 1] - bounds[j]) * cfg.sampling.n_samples_per_prompt,
                cfg.max_prompt_length,
                sampling,
            )
            for j, engine in enumerate(self.engines)
            if isinstance(engine, BuiltinEngineHandle) and bounds[j + 1] > bounds[j]
        ]

        def wait(timeout_s: float) -> dict[str, float]:
            seconds = [w(timeout_s)["warm_up_s"] for w in waits]
            return {"warm_up_s": max(seconds, default=0.0)}

        return wait

    def endpoints(self) -> list[EngineEndpoint]:
        """The engines as ppo_weight_sync endpoints, for ``WeightSender.connect``."""
        return [e.endpoint() for e in self.engines]

    # -- prompts -------------------------------------------------------------------------------------
    def _setup_rollout_function(self, config: RolloutConfig) -> None:
        """The rollout function, and for multi-turn ones the environment and the observation renderer."""
        env_spec = config.resolved_environment
        self.rollout_fn_name = config.resolved_rollout_function
        self.rollout_fn = resolve_rollout_function(self.rollout_fn_name)
        self.multi_turn = self.rollout_fn_name != "single_turn"
        self.environment: EnvironmentFactory | None = resolve_environment(env_spec) if env_spec else None
        self.environment_name = env_spec or ""
        limits = config.multi_turn
        self.observations = (
            ObservationRenderer(
                self.tokenizer,
                chat_template=config.chat_template,
                role=limits.observation_role,
                max_tokens=limits.max_observation_tokens,
                marker=limits.truncation_marker,
                eos_token_ids=_eos_token_ids(config.model_path, self.tokenizer),
            )
            if self.multi_turn
            else None
        )
        # Environments written as plain functions run here, so that one waiting never stalls the others.
        workers = min(64, config.prompts_per_step * config.sampling.n_samples_per_prompt)
        self._env_pool = concurrent.futures.ThreadPoolExecutor(max(1, workers), "environment")

    # -- prompts -------------------------------------------------------------------------------------
    def _groups(self, rows: Sequence[Mapping[str, Any]], samples: int) -> list[PromptGroup]:
        """The step's prompts: rendered (chat template when on) and encoded once, here, for every
        engine kind (SGLang's ``/generate`` takes ``input_ids`` too). The dataset pre-flight
        (``prompts.check_dataset``) encodes with the same function."""
        texts = [self.renderer.render(row) for row in rows]
        ids = encode_texts(self.renderer, texts, self.config.max_prompt_length)
        return [
            PromptGroup(i, row, text, tuple(prompt), samples)
            for i, (row, text, prompt) in enumerate(zip(rows, texts, ids, strict=True))
        ]

    def _rollout(
        self, groups: Sequence[PromptGroup], sampling: SamplingSettings, step: int, stream: int
    ) -> RolloutRun:
        """Every group's trajectories from the rollout function, over the engines; the engines' weight
        versions must not change meanwhile (a weight update never overlaps a rollout)."""
        cfg = self.config
        before = self._weight_versions()

        def context(client: GenerateClient) -> RolloutContext:
            return RolloutContext(
                client,
                tokenizer=self.tokenizer,
                sampling=sampling,
                limits=cfg.multi_turn,
                versions=[_version_number(v) for v in before],
                observations=self.observations,
                environment=self.environment,
                environment_name=self.environment_name,
                environment_args=cfg.environment_args,
                env_pool=self._env_pool,
                step=step,
            )

        # Every step's seeds derive from the run's seed (``config.seed``), whatever the settings hold.
        seeds = ClientSeeds(cfg.seed, step, stream)
        run = run_rollout(
            self.rollout_fn, self.rollout_fn_name, groups, self.engines, context, seeds, cfg.timeout_s
        )
        after = self._weight_versions()
        if before != after:
            raise RuntimeError(
                f"step {step}: the engines' weight versions changed during generation ({before} -> "
                f"{after}); a weight update must not overlap a generate call"
            )
        return run

    def _weight_versions(self) -> list[str | None]:
        """Each engine's weight version, asked of the engine itself."""
        pending = [(e, e.endpoint().get_weight_version()) for e in self.engines]
        out: list[str | None] = []
        for engine, call in pending:
            try:
                version = call.result(self.config.timeout_s)
            except Exception as exc:
                raise RuntimeError(
                    f"engine {engine.endpoint().name}: get_weight_version failed: {exc}"
                ) from exc
            out.append(None if version is None else str(version))
        return out

    def _rewarded(
        self, groups: Sequence[PromptGroup], trajectories: Sequence[Trajectory]
    ) -> list[Trajectory]:
        """The trajectories with their outcome reward: the reward function over the whole batch at once,
        on each trajectory's last turn (its whole response when single-turn). A trajectory whose
        environment failed (``on_env_error: zero``) gets 0 and no turn rewards; a multi-turn one that
        ran out of turns or tokens before its environment ended it gave no final answer: 0 unless
        ``multi_turn.score_unfinished`` (else a tool call with the answer in it, cut by ``max_turns``,
        would score as an answer)."""
        inputs = [self._reward_input(groups[t.prompt_index], t) for t in trajectories]
        rewards = compute_rewards(self.reward_fn, inputs, timeout_s=self.config.reward_timeout_s)
        scores_unfinished = not self.multi_turn or self.config.multi_turn.score_unfinished
        return [
            with_outcome(t, r, score_unfinished=scores_unfinished)
            for t, r in zip(trajectories, rewards, strict=True)
        ]

    def _reward_input(self, group: PromptGroup, t: Trajectory) -> RewardInput:
        last = next(s for s in reversed(t.segments) if s.generated)
        response = str(self.tokenizer.decode(list(last.token_ids), skip_special_tokens=True))
        transcript = (
            response
            if len(t.segments) == 1
            else str(self.tokenizer.decode(list(t.response_tokens), skip_special_tokens=True))
        )
        return RewardInput(
            prompt=group.prompt_text,
            response=response,
            response_token_ids=last.token_ids,
            finish_reason=t.finish_reason,
            row=group.row,
            prompt_index=group.index,
            transcript=transcript,
            num_turns=t.num_turns,
        )

    # -- steps ---------------------------------------------------------------------------------------
    def generate(self, step: int) -> RolloutBatch:
        """Roll out ``prompts_per_step`` prompts x ``n_samples_per_prompt`` and pack one Box per dp rank.

        Outcome rewards get the overlong penalty (``rollout.overlong``); with
        ``rollout.dynamic_sampling`` the groups whose raw scores do not vary are dropped and more
        prompts rolled out until ``prompts_per_step`` groups are kept (``dynamic_sampling``)."""
        if self._offloaded:
            raise RuntimeError("rollout engines are offloaded; call onload() before generate()")
        cfg = self.config
        t0 = time.perf_counter()
        runs: list[RolloutRun] = []

        def roll(round_: int, prompts: int) -> list[list[Trajectory]]:
            # Each round draws new rows (the saved data position advances by all of them) and samples
            # from its own stream: the step stays a function of (seed, step, data position).
            rows = self.source.next_rows(prompts)
            groups = self._groups(rows, cfg.sampling.n_samples_per_prompt)
            run = self._rollout(groups, cfg.sampling, step, stream=0 if round_ == 0 else 2 + round_)
            runs.append(run)
            rewarded = shape_overlong(
                self._rewarded(groups, run.trajectories), cfg.overlong, cfg.train_response_limit
            )
            by_prompt: dict[int, list[Trajectory]] = {g.index: [] for g in groups}
            for t in rewarded:
                by_prompt[t.prompt_index].append(t)
            return list(by_prompt.values())

        dynamic: dict[str, float] = {}
        if cfg.dynamic_sampling.enabled:
            selection = select_groups(roll, cfg.prompts_per_step, cfg.dynamic_sampling)
            trajectories, dynamic = selection.trajectories, selection.metrics
        else:
            trajectories = [t for g in roll(0, cfg.prompts_per_step) for t in g]
        run = _combined(runs, trajectories)
        ids = split_indices(trajectories, self.dp_size)
        boxes = [pack_fields(rank_fields([trajectories[i] for i in part])) for part in ids]
        critic_ids, critic_boxes = ids, boxes
        if self.critic_dp_size != self.dp_size:
            critic_ids = split_indices(trajectories, self.critic_dp_size)
            critic_boxes = [pack_fields(rank_fields([trajectories[i] for i in part])) for part in critic_ids]
        return RolloutBatch(
            boxes=boxes,
            metrics=self._step_metrics(trajectories, run, time.perf_counter() - t0) | dynamic,
            sample_ids=ids,
            critic_boxes=critic_boxes,
            critic_sample_ids=critic_ids,
        )

    def _step_metrics(
        self, trajectories: Sequence[Trajectory], run: RolloutRun, seconds: float
    ) -> dict[str, float]:
        versions = [min(t.weight_versions) for t in trajectories]
        generated = sum(t.generated_tokens for t in trajectories)
        metrics = sample_metrics(trajectories) | {
            "rollout/generate_seconds": run.seconds,
            "rollout/tokens_per_second": generated / run.seconds if run.seconds > 0 else 0.0,
            "rollout/seconds": seconds,
            "rollout/weight_version_min": float(min(versions)),
            "rollout/weight_version_max": float(max(versions)),
        }
        if self.multi_turn:
            metrics |= multi_turn_metrics(trajectories) | {
                "rollout/engine_idle_share": run.engine_idle_share,
                "rollout/engine_calls": float(run.engine_calls),
            }
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """Reward, accuracy and response length on ``eval_prompts`` fixed held-out prompts, twice:
        greedy (``eval_sampling`` when set; ``eval/reward_mean``, ``eval/accuracy``, ...) and with the
        training sampling (``eval/sampled_reward_mean``, ...). A sample is correct when its reward (all
        its turns' together) is at least 1 (``exact_match``, ``math_answer``: 1 is right). ``step`` no
        longer seeds anything: every evaluation draws alike (below)."""
        cfg = self.config
        if cfg.eval_prompts == 0:
            return {}
        if self._offloaded:
            raise RuntimeError("rollout engines are offloaded; call onload() before evaluate()")
        greedy = cfg.eval_sampling or SamplingSettings(
            temperature=0.0,
            max_new_tokens=cfg.sampling.max_new_tokens,
            stop_token_ids=cfg.sampling.stop_token_ids,
            n_samples_per_prompt=1,
        )
        prompts = self._groups(self.source.eval_rows(cfg.eval_prompts), 1)
        metrics: dict[str, float] = {}
        for prefix, sampling, stream in (("", greedy, 1), ("sampled_", cfg.sampling, 2)):
            groups = [replace(g, samples=sampling.n_samples_per_prompt) for g in prompts]
            # Seeded as step 0 at every evaluation: the same draws each time, so the curve shows the
            # policy's change and not the sampling noise.
            run = self._rollout(groups, sampling, 0, stream=stream)
            trajectories = self._rewarded(groups, run.trajectories)
            rewards = [t.total_reward for t in trajectories]
            metrics |= {
                f"eval/{prefix}reward_mean": statistics.fmean(rewards),
                f"eval/{prefix}accuracy": sum(r >= CORRECT_REWARD for r in rewards) / len(rewards),
                f"eval/{prefix}response_length_mean": statistics.fmean(
                    len(t.response_tokens) for t in trajectories
                ),
                f"eval/{prefix}samples": float(len(trajectories)),
            }
            if self.multi_turn:
                metrics |= multi_turn_metrics(trajectories, prefix=f"eval/{prefix}")
        return metrics

    # -- colocated runs --------------------------------------------------------------------------------
    def _memory(self, op: str, tags: Sequence[str] | None) -> None:
        failures = []
        for engine in self.engines:
            call = engine.release_memory_occupation if op == "release" else engine.resume_memory_occupation
            reply = call(tags, self.config.timeout_s)
            if not reply.success:
                failures.append(f"{engine.name}: {reply.message}")
        if failures:
            raise RuntimeError(f"{op} of rollout memory failed on " + "; ".join(failures))

    def offload(self) -> None:
        """Every engine releases its weights and KV cache (idempotent); colocated runs, driver's command."""
        self._memory("release", list(MEMORY_TAGS))
        self._offloaded = True

    def onload(self) -> None:
        """Every engine takes its weights and KV cache back (idempotent)."""
        self._memory("resume", list(MEMORY_TAGS))
        self._offloaded = False

    @property
    def is_offloaded(self) -> bool:
        return self._offloaded

    def pop_metrics(self) -> dict[str, float]:
        """Bytes and seconds the engines' offloads and onloads moved since the last call, summed
        over the engines: ``offload/bytes``, ``offload/seconds``, ``onload/bytes``, ``onload/seconds``
        (the engines' own timing). Empty when an engine does not report them (SGLang)."""
        totals = {"offload/bytes": 0.0, "offload/seconds": 0.0, "onload/bytes": 0.0, "onload/seconds": 0.0}
        # The calls go out together: one engine's answer does not wait for another's.
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.engines))) as pool:
            answers = list(pool.map(lambda e: e.memory_stats(self.config.timeout_s), self.engines))
        for engine, stats in zip(self.engines, answers, strict=True):
            if stats is None:
                return {}
            before = self._memory_seen.get(engine.name, {})
            for key, ours in (("release", "offload"), ("restore", "onload")):
                for what in ("bytes", "seconds"):
                    name = f"{key}_{what}"
                    totals[f"{ours}/{what}"] += stats.get(name, 0.0) - before.get(name, 0.0)
            self._memory_seen[engine.name] = dict(stats)
        return totals

    def weights_checksums(self) -> list[str]:
        """``ppo_weight_sync.checksum`` of each engine's weights (built-in engines only)."""
        # Together: hashing a 1B-parameter model's weights takes seconds per engine.
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.engines))) as pool:
            return list(pool.map(lambda e: e.weights_checksum(self.config.timeout_s), self.engines))

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data position. Sampling seeds are a function of (seed, step, engine): no RNG state to keep."""
        return {"version": 1, "data": self.source.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != 1 or "data" not in state:
            raise ValueError(f"not a rollout state (expected version 1 with 'data'): keys {sorted(state)}")
        self.source.load_state_dict(state["data"])

    def shutdown(self) -> None:
        self._env_pool.shutdown(wait=False, cancel_futures=True)
        engines, self.engines = self.engines, []
        for engine in engines:
            # Best effort: one engine failing to stop must not leave the others running.
            with contextlib.suppress(Exception):
                engine.shutdown()
