"""The PPO loop, top to bottom.

Setup: Ray, placement groups, the rollout manager and its engines, the actor (and critic) groups,
resume from the latest complete checkpoint, the first weight update. Then each step:

1. generate (engines resident), or take the batch generated during the previous step
   (``train.async: one_step_off``, ``schedule.py``), and start the next one;
2. the critic trains first and returns its values (colocated engines offloaded before it);
3. the critic sleeps, the actor trains with the critic's values;
4. save when due: the driver's state now, each role's from the host copies of its next sleep, written
   in the background while the loop goes on (``saving.py``; COMPLETE once every file is on disk);
5. update the engines' weights (the actor reconnects to the engines if it slept);
6. onload the engines, evaluate when due.

Every sleep and wake is the driver's, taken from ``OffloadPlan.transitions`` between phases; the
workers only carry them out. ``offload.overlap`` (``overlap.py``, decided right after start-up) runs
them in the background and wakes the next phase's roles ahead (``phases.py``). A critic-only
warm-up step (``train.num_critic_only_steps``) skips 3 and 5; a GRPO run has no critic and skips 2.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import ray
import ray.exceptions
import torch
from rich.console import Console

from ppo_driver import budget, build, checkpoint, children, processes, reaper
from ppo_driver.config import RunConfig, dump_config
from ppo_driver.faults import (
    Interrupted,
    NonFiniteError,
    RunFailed,
    StopSignals,
    check_finite,
    resume_hint,
)
from ppo_driver.metrics import METRICS_FILE, MetricsLog, StepProgress
from ppo_driver.overlap import OverlapChoice, choose_overlap
from ppo_driver.phases import PhaseTracker, TransitionFailed
from ppo_driver.roles import RoleFactory, Roles, create_roles, critic_dp_size, shutdown_roles
from ppo_driver.runlock import RunLock
from ppo_driver.saving import CheckpointSaver
from ppo_driver.schedule import BatchSchedule
from ppo_lifecycle import Phase
from ppo_trainer.errors import NonFiniteWeightsError
from ppo_value_transport import pair_values


@dataclass
class RunResult:
    run_dir: Path
    first_step: int  # first step this invocation ran (resumed runs start after their checkpoint)
    last_step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    actor_checksum: str = ""
    engine_checksums: list[str] = field(default_factory=list)
    # Set when the run was already done: the checkpoint at or past ``train.steps`` (nothing was started)
    finished_at: Path | None = None

    @property
    def weights_match(self) -> bool:
        return bool(self.engine_checksums) and all(c == self.actor_checksum for c in self.engine_checksums)


def train(
    config: RunConfig,
    run_dir: Path,
    *,
    console: Console | None = None,
    roles_factory: RoleFactory = create_roles,
) -> RunResult:
    """Run the loop. A failing step raises ``RunFailed`` (step, phase, cause, where a re-run resumes);
    SIGINT/SIGTERM raise ``Interrupted`` after a save at the end of the step they arrived in."""
    console = console or Console()
    # Absolute paths: the Ray workers that read the model and write checkpoints run in other folders.
    run_dir = run_dir.resolve()
    ckpt_root = Path(config.checkpoint.dir).resolve() if config.checkpoint.dir else run_dir / "checkpoints"
    timeout_s = config.ray.timeout_s
    at = _Where()
    spared = set(reaper.descendants(os.getpid()))  # not the run's: a second Ctrl-C leaves them be
    with ExitStack() as stack:
        stack.enter_context(RunLock(run_dir))  # creates run_dir; refuses a second run in it
        # The content hashes of the checkpoints to resume from are checked while Ray and the roles start.
        verified = checkpoint.BackgroundVerify(ckpt_root) if config.checkpoint.resume else None
        done = _already_done(ckpt_root, verified, config.train.steps)
        if done is not None:  # decided before anything starts: the finished run's files stay as they are
            console.print(
                f"nothing to do: {done[1]} is at step {done[0]} >= train.steps={config.train.steps}; "
                f"the run's files are as it left them (raise train.steps to train on, or set "
                "checkpoint.resume=false to start over)",
                highlight=False,
            )
            return RunResult(run_dir, first_step=done[0] + 1, last_step=done[0], finished_at=done[1])
        if not config.checkpoint.resume:
            _start_over(run_dir, ckpt_root, console)
        (run_dir / "config.yaml").write_text(dump_config(config))
        checkpoint.remove_unfinished(ckpt_root)  # saves a failed or killed run never completed
        _check_space(config, ckpt_root)  # a save that cannot fit fails now, not minutes into the run
        try:
            stack.enter_context(_ray_session(config, console))
        except Exception as exc:  # Ray did not start (twice, for a local instance): one line, as any stop
            raise RunFailed(0, "setup", exc, resume_hint(checkpoint.latest_complete(ckpt_root))) from exc
        signals = stack.enter_context(
            StopSignals(on_second=lambda signum: _stop_at_once(signum, at, ckpt_root, spared))
        )
        # Entered before the roles: their shutdown runs first, then a failure is reported.
        stack.enter_context(_report_failures(at, ckpt_root, run_dir))
        seed_everything(config.train.seed)
        model_path = _model_path(config, run_dir)
        # The roles' start-up (processes importing torch, loading the model) is most of a short run's
        # time: say what is starting, and how long it took, rather than staying silent through it.
        starting = time.perf_counter()
        console.print(f"starting {_role_names(config)} ...", highlight=False)
        roles = roles_factory(config, model_path, timeout_s)
        console.print(f"started in {time.perf_counter() - starting:.1f} s", highlight=False)
        stack.callback(shutdown_roles, roles)
        processes.record(roles, run_dir, timeout_s)
        rollout, actor, critic = roles.rollout, roles.actor, roles.critic
        plan = build.offload_plan(config)
        overlap = _choose_overlap(config, roles)  # measured now, with every role resident
        console.print(overlap.describe(), highlight=False)
        phases = PhaseTracker(plan, roles, on_enter=at.entering, overlap=overlap.overlap, timeout_s=timeout_s)
        stack.callback(phases.close)  # before the roles shut down: nothing left moving
        saver = CheckpointSaver(
            ckpt_root,
            roles,
            phases,
            lambda step: _driver_state(step, roles, config),
            keep=config.checkpoint.keep,
        )

        # Resume: model, optimizer, critic, step, RNG and data position from the latest checkpoint that
        # loads (one that does not is reported and skipped for the previous one).
        at.phase = "resume"
        start = _resume(ckpt_root, verified, roles, phases.enter, config, console) if verified else 0

        # First weight update: the engines start from the actor's weights (the loaded ones on resume).
        at.step = start
        phases.enter("weight_update")
        actor.connect_engines(rollout.endpoints())
        actor.update_weights(version=str(start))
        phases.enter("generate")
        # What start-up moved (its sleeps, wakes and first weight update) is not any step's budget.
        phases.settle()
        setup_metrics = phases.pop_role_metrics()
        budget_roles = tuple(budget.budget_role(r) for r in plan.roles)

        # train.async=one_step_off: step t + 1's batch is generated while step t trains (schedule.py).
        schedule = BatchSchedule(
            rollout,
            config.train.async_,
            last_step=config.train.steps,
            saves_at=lambda s: _due(
                s, config.checkpoint.interval, config.train.steps, config.checkpoint.save_final
            ),
            timeout_s=timeout_s,
        )
        stack.callback(schedule.close)
        published = start  # the latest weight version sent to the engines

        log = MetricsLog(run_dir, tensorboard=config.logging.tensorboard, start_step=start)
        stack.callback(log.close)
        progress = stack.enter_context(
            StepProgress(config.train.steps, start, console=console, enabled=config.logging.progress)
        )
        _stop_if_asked(signals, start, ckpt_root)
        for step in range(start + 1, config.train.steps + 1):
            at.step = step
            timer = budget.StepClock()  # every second of the step, in disjoint parts (budget.py)
            phases.start_step(timer, step)
            trains_actor = step > config.train.num_critic_only_steps
            # The phase after each one, for the roles an overlapped run wakes ahead (phases.py).
            after_generate: Phase | None = (
                "critic_train" if critic is not None else "actor_train" if trains_actor else None
            )
            saved = False

            with timer.span("generate"):
                phases.enter("generate", then=after_generate)
                batch = schedule.batch(step)
            # Overlapped, the end of the last step woke a role ahead and the checkpoint's poll there
            # skipped it (it asks no role that is moving); after each phase the roles it moved have
            # usually settled, so a checkpoint whose writers are done completes within a step.
            _poll_between_phases(saver, timer, at)
            metrics: dict[str, Any] = dict(batch.metrics)
            metrics["rollout/staleness"] = _check_staleness(step, batch.metrics, published)
            metrics["rollout/prefetched_next"] = int(schedule.start_next(step))

            values = None
            handoff_bytes = 0
            if critic is not None:
                with timer.span("critic_train"):
                    # Offloads colocated engines, wakes the critic.
                    phases.enter("critic_train", then="actor_train" if trains_actor else "generate")
                    result = critic.train(step, batch.critic_boxes)
                    timer.carve("handoff", result.metrics.get("handoff_put_s", 0.0))
                check_finite("critic", step, result.metrics)
                if result.values is None or len(result.values) == 0:
                    raise RuntimeError(f"step {step}: the critic returned no values for the actor")
                with timer.span("handoff"):
                    # The critic's ranks may hold the samples in another split: rows go by sample id.
                    values = pair_values(result.values, batch.critic_sample_ids, batch.sample_ids)
                metrics.update(_prefixed("critic", result.metrics))
                metrics["handoff/value_boxes"] = len(result.values)
                handoff_bytes = sum(max(box.nbytes, 0) for box in result.values if box is not None)

            if trains_actor:
                with timer.span("actor_train"):
                    phases.enter("actor_train", then="weight_update")  # the critic sleeps, the actor wakes
                    result = actor.train(step, batch.boxes, values)
                    timer.carve("handoff", result.metrics.get("handoff_get_s", 0.0))
                # Before the save and the weight update: non-finite weights reach neither.
                check_finite("actor", step, result.metrics)
                metrics.update(_prefixed("actor", result.metrics))
                _poll_between_phases(saver, timer, at)
                if values is not None:
                    metrics["handoff/values_used"] = 1

            if _due(step, config.checkpoint.interval, config.train.steps, config.checkpoint.save_final):
                with timer.span("save"), at.within("save"):
                    saver.start(step)  # the roles' files follow once they sleep (saving.py)
                    saved = True

            with timer.span("generate_wait"):
                schedule.drain()  # the engines finish the next batch before their weights change
            if trains_actor:
                with timer.span("weight_update"):
                    phases.enter("weight_update")  # the actor reconnects to the engines if it slept
                    update = actor.update_weights(version=str(step))
                metrics.update(_prefixed("weight_sync", update))
                published = step
                if config.train.check_weights:
                    with timer.span("check_weights"):
                        check_weights_match(step, roles)

            last = step == config.train.steps or signals.requested is not None
            # Onload the engines; wake the next step's first role ahead, unless a checkpoint still
            # waits for this step's sleeps (saving.py), or no step follows.
            phases.enter("generate", then=None if last or saved else _first_phase(config))
            with timer.span("save"), at.within("save"):
                saver.launch_ready()  # every trainer role asleep now: background saves start
            if _due(step, config.rollout.eval_interval, config.train.steps, final=True):
                with timer.span("eval"):
                    metrics.update(_prefixed("eval", rollout.evaluate(step)))

            if last:
                phases.settle()  # no later phase hides what still moves: the step waits for it
            popped = phases.pop_role_metrics()
            for role, role_metrics in popped.items():
                metrics.update(_prefixed(role, role_metrics))
            metrics.update(phases.step_metrics())
            with timer.span("save"), at.within("save"):
                if step == config.train.steps or signals.requested is not None:
                    saver.wait()  # the run ends or stops after this step: its checkpoint must be complete
                else:
                    saver.poll()  # complete the pending checkpoint if its writers are done; never waits
            # The older inclusive keys: each phase's wall time with the transitions it triggered.
            metrics.update({f"time/{k}": v for k, v in timer.totals().items() if k in budget.PHASES})
            metrics.update(
                budget.step_metrics(
                    timer,
                    budget_roles,
                    budget.StepBytes(
                        transitions=_transition_bytes(popped),
                        handoff=float(handoff_bytes),
                        weight_update=float(metrics.get("weight_sync/bytes", 0.0)) if trains_actor else 0.0,
                    ),
                    hidden=phases.hidden_seconds(),
                )
            )
            metrics["time/step"] = metrics["time/step_s"]
            metrics.update(saver.pop_metrics())
            metrics["actor_trained"] = int(trains_actor)
            log.log(step, metrics)
            progress.update(step, metrics)
            if signals.requested is not None and step < config.train.steps:
                if not saved:  # a safe point: the step is whole; save it so the re-run loses nothing
                    with at.within("save"):
                        saver.start(step)
                        saver.wait()
                _stop_if_asked(signals, step, ckpt_root)
        with at.within("save"):
            saver.wait()
        phases.settle()

        actor_checksum = actor.weights_checksum()
        engine_checksums = list(rollout.weights_checksums())
        result_ = RunResult(
            run_dir=run_dir,
            first_step=start + 1,
            last_step=max(start, config.train.steps),
            history=log.history,
            actor_checksum=actor_checksum,
            engine_checksums=engine_checksums,
        )
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "first_step": result_.first_step,
                    "last_step": result_.last_step,
                    "actor_checksum": actor_checksum,
                    "engine_checksums": engine_checksums,
                    "weights_match": result_.weights_match,
                    "budget": budget.summary(log.history),
                    "setup": setup_metrics,
                    "transitions": {"overlap": overlap.overlap, "reason": overlap.reason},
                },
                indent=1,
            )
            + "\n"
        )
        return result_
    raise AssertionError("unreachable")  # ExitStack does not swallow exceptions


@dataclass
class _Where:
    """Where the loop is, for the report of a failure."""

    step: int = 0
    phase: str = "setup"

    def entering(self, phase: str) -> None:
        self.phase = phase

    @contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """Work of ``phase`` done inside another (a save's writers start when the roles sleep)."""
        outer, self.phase = self.phase, phase
        yield
        self.phase = outer  # not restored on an error: the report names the inner phase


@contextmanager
def _report_failures(at: _Where, ckpt_root: Path, run_dir: Path) -> Iterator[None]:
    """Turn an error of the run into ``RunFailed``: the step, the phase, and where a re-run resumes."""
    try:
        yield
    except (Interrupted, RunFailed):
        raise
    except Exception as exc:
        error = _non_finite_weights(exc, at.step) or _disk_full(exc, run_dir) or exc
        # A background sleep or wake is reported in the phase (and step) that started it.
        step, phase = (exc.step, exc.phase) if isinstance(exc, TransitionFailed) else (at.step, at.phase)
        raise RunFailed(step, phase, error, resume_hint(checkpoint.latest_complete(ckpt_root))) from error


def _check_space(config: RunConfig, ckpt_root: Path) -> None:
    """Stop with one line, before anything starts, when the checkpoint folder's disk cannot hold the
    next checkpoint: as large as the latest one, or (a first run from a local model folder) about
    its weights' size times the copies a checkpoint holds. Nothing to compare for the tiny model, or
    for a run that saves nothing."""
    if config.checkpoint.interval <= 0 and not config.checkpoint.save_final:
        return
    needed = checkpoint.checkpoint_bytes(ckpt_root) or _checkpoint_estimate(config)
    try:
        checkpoint.check_space(ckpt_root, needed)
    except checkpoint.DiskFullError as exc:
        raise RunFailed(0, "setup", exc, resume_hint(checkpoint.latest_complete(ckpt_root))) from exc


# Copies of the weights' bytes one checkpoint holds: the actor's model, its two Adam moments and its
# Hugging Face export; the critic's model and moments.
_COPIES_WITH_CRITIC = 7
_COPIES_WITHOUT = 4


def _checkpoint_estimate(config: RunConfig) -> int | None:
    if config.model.path is None or not Path(config.model.path).expanduser().is_dir():
        return None
    folder = Path(config.model.path).expanduser()
    weights = sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    return weights * (_COPIES_WITH_CRITIC if config.use_critic else _COPIES_WITHOUT) or None


def _disk_full(exc: BaseException, folder: Path) -> checkpoint.DiskFullError | None:
    """A full disk met outside a checkpoint's save (the run folder's files, the tiny model), named as
    one; a save's own is already a ``DiskFullError``."""
    if isinstance(exc, checkpoint.DiskFullError) or not checkpoint.is_disk_full(exc):
        return None
    error = checkpoint.disk_full(folder, None, "while writing the run's files")
    error.__cause__ = exc
    return error


def _non_finite_weights(exc: BaseException, step: int) -> NonFiniteError | None:
    """A worker's refusal to save or send non-finite weights (through Ray), as the run's report."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.RayTaskError):
            seen = seen.cause  # the worker's own exception, with its fields
        if isinstance(seen, NonFiniteWeightsError):
            error = NonFiniteError(seen.role, step, {}, weights=(seen.rank, seen.names))
            error.__cause__ = exc
            return error
        seen = seen.__cause__ if seen is not None else None
    return None


def _stop_at_once(signum: int, at: _Where, ckpt_root: Path, spared: set[int]) -> NoReturn:
    """A second SIGINT/SIGTERM: no safe point is awaited. Every process the run started (the local Ray
    instance and its workers) is killed, which leaves a checkpoint being written as a ``.tmp-`` folder
    that resume discards: its COMPLETE marker is written last, after every file. One line says where
    a re-run resumes; the exit code is 128 + the signal's number."""
    for _ in range(3):  # a process started while the first ones were killed is found the next time
        if not reaper.kill_all({p: t for p, t in reaper.descendants(os.getpid()).items() if p not in spared}):
            break
    sys.stderr.write(
        f"stopped at once by a second {signal.Signals(signum).name} in step {at.step}, phase {at.phase}; "
        f"every process the run started was ended; {resume_hint(checkpoint.latest_complete(ckpt_root))}\n"
    )
    sys.stderr.flush()
    os._exit(128 + signum)  # nothing else to wait for: the lock goes with the process


def _stop_if_asked(signals: StopSignals, step: int, ckpt_root: Path) -> None:
    if signals.requested is not None:
        raise Interrupted(signals.requested, step, resume_hint(checkpoint.latest_complete(ckpt_root)))


def _already_done(
    ckpt_root: Path, verified: checkpoint.BackgroundVerify | None, steps: int
) -> tuple[int, Path] | None:
    """The latest complete checkpoint, when it is whole and at or past ``steps``: nothing to train."""
    found = checkpoint.latest_complete(ckpt_root)
    if verified is None or found is None or found[0] < steps:
        return None
    try:
        verified.check(found[1])
    except (checkpoint.CheckpointError, OSError):
        return None  # the resume reports it and falls back to an earlier checkpoint
    return found


def _resume(
    ckpt_root: Path,
    verified: checkpoint.BackgroundVerify,
    roles: Roles,
    enter: Callable[[Phase], None],
    config: RunConfig,
    console: Console,
) -> int:
    """Load the latest complete checkpoint that loads; return its step (0 when there is none)."""
    for _, folder in checkpoint.unmarked_checkpoints(ckpt_root):
        console.print(
            f"[yellow]warning:[/] checkpoint {folder} is skipped: it has no {checkpoint.MARKER} marker "
            "(copied in part, or the marker was removed), so nothing says its files are whole",
            highlight=False,
        )
    found = checkpoint.complete_checkpoints(ckpt_root)
    for step, folder in reversed(found):
        try:
            verified.check(folder)
            state = checkpoint.load_driver_state(folder)  # also restores the driver's RNG
            # One role resident at a time: the phases that train each have it so.
            enter("actor_train")
            roles.actor.load(folder / "actor")
            if roles.critic is not None:
                enter("critic_train")
                roles.critic.load(folder / "critic")
            roles.rollout.load_state_dict(dict(state.rollout))
        except Exception as exc:
            if is_process_death(exc):
                raise  # not the checkpoint's fault
            console.print(
                f"[yellow]warning:[/] checkpoint {folder} does not load ({_first_line(exc)}); "
                "trying the previous complete one",
                highlight=False,
            )
            continue
        console.print(f"resumed from {folder} (step {step})", highlight=False)
        changed = changed_fields(state.extra.get("config", {}), config)
        if changed:
            console.print(
                f"[yellow]warning:[/] resuming with a config that differs from the checkpoint's in "
                f"{', '.join(changed)}; the run will not match an uninterrupted one",
                highlight=False,
            )
        return step
    if found:
        # Some roles may hold part of a checkpoint now: starting from step 0 would not be a fresh run.
        raise checkpoint.CheckpointError(
            f"none of the {len(found)} complete checkpoints under {ckpt_root} loads (see the warnings "
            "above); move that folder aside to start over, or set checkpoint.resume=false"
        )
    return 0


def _start_over(run_dir: Path, ckpt_root: Path, console: Console) -> None:
    """``checkpoint.resume=false``: keep an older run's checkpoints and metrics, out of the new run's way."""
    aside = checkpoint.move_aside(ckpt_root)
    if aside is not None:
        console.print(
            f"checkpoint.resume=false: moved the earlier run's checkpoints from {ckpt_root} to {aside}",
            highlight=False,
        )
    metrics = run_dir / METRICS_FILE
    if metrics.exists():
        old = metrics.with_name(f"metrics.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        metrics.rename(old)
        console.print(f"checkpoint.resume=false: moved the earlier run's metrics to {old}", highlight=False)


def is_process_death(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.RayActorError):
            return True
        seen = seen.__cause__
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # Ray's task errors start with a header line; the worker's own message is the last line.
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


def _driver_state(step: int, roles: Roles, config: RunConfig) -> checkpoint.DriverState:
    return checkpoint.DriverState(
        step=step,
        rollout=roles.rollout.state_dict(),
        extra={
            "config": config.model_dump(mode="json"),
            "config_sha256": config_digest(config),
            "time": time.time(),
        },
    )


# Fields a resumed run may change without changing what it computes.
RESUME_FREE = (
    "train.steps",
    "train.check_weights",
    "checkpoint.",
    "logging.",
    "ray.",
    "rollout.eval_interval",
    "rollout.eval_dataset",
)


def changed_fields(saved: Mapping[str, Any], config: RunConfig) -> list[str]:
    """Dotted names whose value differs between a checkpoint's saved config and ``config``."""
    if not saved:  # a checkpoint that recorded no config: nothing to compare
        return []
    now = _flatten(config.model_dump(mode="json"))
    before = _flatten(saved)
    names = sorted(set(now) | set(before))
    return [
        n
        for n in names
        if now.get(n) != before.get(n) and not any(n == f or n.startswith(f) for f in RESUME_FREE)
    ]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def config_digest(config: RunConfig) -> str:
    return hashlib.sha256(dump_config(config).encode()).hexdigest()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --- helpers -------------------------------------------------------------------------------------


def _check_staleness(step: int, batch_metrics: Mapping[str, Any], published: int) -> int:
    """Weight versions between the batch's oldest sample and the latest published weights: 0 in the
    synchronous loop, at most 1 one step off (anything more is a scheduling bug, stopped here)."""
    oldest = batch_metrics.get("rollout/weight_version_min", -1.0)
    if oldest < 0:  # the engines report no numeric version: nothing to check
        return 0
    behind = int(published - oldest)
    if behind > 1:
        raise RuntimeError(
            f"step {step}: the batch was generated with weight version {int(oldest)}, {behind} versions "
            f"behind the published {published}; at most one is allowed"
        )
    return behind


def check_weights_match(step: int, roles: Roles) -> None:
    """Every engine holds the actor's weights (``train.check_weights``, after each update)."""
    # The engines hash their weights while the actor hashes its own (each is seconds at 1B parameters).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="check-weights") as pool:
        on_engines = pool.submit(roles.rollout.weights_checksums)
        actor = roles.actor.weights_checksum()
        engines = list(on_engines.result())
    wrong = [i for i, c in enumerate(engines) if c != actor]
    if wrong or not engines:
        raise RuntimeError(
            f"step {step}: after the weight update, engine(s) {wrong} hold other weights than the actor "
            f"(actor {actor[:12]}, engines {[c[:12] for c in engines]}); the update did not land"
        )


def _choose_overlap(config: RunConfig, roles: Roles) -> OverlapChoice:
    """``offload.overlap`` resolved (``overlap.py``); device memory is read only where auto needs it."""
    o, device = config.offload, config.placement.device
    memory: list[dict[str, float]] = []
    if o.overlap == "auto" and o.enabled and device == "cuda":
        for group in (roles.actor, roles.critic):
            if group is not None:
                memory.extend(group.memory_info())
    return choose_overlap(
        o.overlap, device=device, offload=o.enabled, memory=memory, headroom_gb=o.overlap_headroom_gb
    )


def _first_phase(config: RunConfig) -> Phase:
    """The phase after ``generate`` in a step that follows (warm-up steps train the critic too)."""
    return "critic_train" if config.use_critic else "actor_train"


def _transition_bytes(popped: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Bytes per budget transition (``"actor/sleep"``) from the roles' popped metrics. Trainers
    report rank 0's bytes (one GPU's share); the engines' are summed over the engines."""
    out: dict[str, float] = {}
    for role in ("actor", "critic"):
        if role in popped:
            out[f"{role}/sleep"] = float(popped[role].get("sleep/bytes", 0.0))
            out[f"{role}/wake"] = float(popped[role].get("wake/bytes", 0.0))
    engines = popped.get("rollout", {})
    out["engines/sleep"] = float(engines.get("offload/bytes", 0.0))
    out["engines/wake"] = float(engines.get("onload/bytes", 0.0))
    return out


def _poll_between_phases(saver: CheckpointSaver, timer: budget.StepClock, at: _Where) -> None:
    """Complete a pending checkpoint whose writers are done (never waits; booked as saving)."""
    if saver.pending:
        with timer.span("save"), at.within("save"):
            saver.poll()


def _prefixed(role: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k if k.startswith(f"{role}/") else f"{role}/{k}": v for k, v in metrics.items()}


def _due(step: int, interval: int, last: int, final: bool) -> bool:
    return (interval > 0 and step % interval == 0) or (final and step == last)


def _model_path(config: RunConfig, run_dir: Path) -> Path:
    if config.model.path is not None:
        local = Path(config.model.path).expanduser()
        return local.resolve() if local.exists() else local  # else a name the workers resolve
    if config.rollout.task is None:
        raise ValueError("model.path is null (the built-in tiny model) but rollout.task is not set")
    from transformers.utils import logging as hf_logging

    from ppo_rollout import make_tiny_model

    hf_logging.disable_progress_bar()  # one tiny shard: a progress bar is noise in the run's output
    tiny = config.model.tiny
    return make_tiny_model(
        config.rollout.task,
        run_dir / "model",
        config.train.seed,
        hidden_size=tiny.hidden_size,
        num_layers=tiny.num_layers,
        num_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        max_positions=tiny.max_positions,
    )


def _role_names(config: RunConfig) -> str:
    """What a run starts, e.g. "2 rollout engines, the actor (2 ranks), the critic (2 ranks)"."""

    def ranks(n: int) -> str:
        return f"{n} rank{'s' if n != 1 else ''}"

    count = config.placement.num_engines
    engines = "the rollout engine" if count == 1 else f"{count} rollout engines"
    critic = critic_dp_size(config)
    critic_part = f", the critic ({ranks(critic)})" if critic is not None else ""
    return f"{engines}, the actor ({ranks(config.placement.actor_gpus)}){critic_part}"


@contextmanager
def _ray_session(config: RunConfig, console: Console) -> Iterator[None]:
    """Join ``ray.address`` when given; otherwise start (and later stop) a local Ray instance."""
    if ray.is_initialized():
        yield
        return
    watchdog: reaper.Reaper | None = None
    if config.ray.address:
        ray.init(address=config.ray.address, log_to_driver=config.logging.worker_logs)
    else:
        # Ends the local instance's processes if this one dies without a word (reaper.py).
        watchdog = reaper.start()
        try:
            start_local_ray(config, console)
        except BaseException:
            if watchdog is not None:
                watchdog.stop()
            raise
    try:
        yield
    finally:
        ray.shutdown()
        if watchdog is not None:
            watchdog.stop()  # whatever Ray's shutdown left running is ended now


# Ray waits a fixed 30 s for its raylet to register; on a loaded machine (load average above 10 on
# 2 cores) that is too short, and a worker importing torch can miss its registration window.
LOCAL_RAY_ENV = {
    "RAY_worker_register_timeout_seconds": "300",
    # The raylet waits 30 s for its dashboard agent's port file, then aborts (a Python process that
    # took longer than that to import at a load average of 20 on 2 cores).
    "RAY_agent_register_timeout_ms": "300000",
    "RAY_gcs_server_port_wait_time_s": "60",
    "RAY_gcs_server_request_timeout_seconds": "180",
}
# The retry waits at least this long for each start-up stage, whatever the environment asked for.
LOCAL_RAY_RETRY_ENV = {"RAY_gcs_server_port_wait_time_s": "180"}


def start_local_ray(config: RunConfig, console: Console) -> None:
    """Start a local Ray instance; if it does not come up, say so, end what the failed start left
    running, and try once more with longer start-up waits."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = {
        "num_cpus": config.ray.num_cpus,
        "num_gpus": 0 if config.placement.device == "cpu" else None,
        "object_store_memory": config.ray.object_store_memory_mb * 1024**2,
        "include_dashboard": False,
        "log_to_driver": config.logging.worker_logs,
    }
    before = children.child_pids()
    try:
        ray.init(**kwargs)
    except Exception as exc:  # Ray raises a bare Exception for "timed out during startup"
        console.print(
            f"[yellow]warning:[/] the local Ray instance did not start ({_first_line(exc)}); "
            "the machine may be loaded: trying once more with longer start-up waits",
            highlight=False,
        )
        ray.shutdown()
        # A start that failed midway leaves its GCS server (and maybe a raylet) running: ray.shutdown()
        # knows nothing of a node that never finished starting.
        children.end_processes(children.child_pids() - before)
        for key, value in LOCAL_RAY_RETRY_ENV.items():
            if float(os.environ.get(key, "0")) < float(value):
                os.environ[key] = value
        ray.init(**kwargs)
