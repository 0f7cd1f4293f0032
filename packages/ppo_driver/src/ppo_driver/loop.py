"""The PPO loop: :func:`setup`, then :func:`step` for each step, then :func:`finish`.

Setup: Ray, placement groups, the rollout manager and its engines, the actor (and critic) groups,
resume from the latest complete checkpoint, the first weight update. Then each step:

1. generate (engines resident), or take the batch generated during the previous step
   (``train.async: one_step_off``, ``schedule.py``), and start the next one;
2. the critic trains first and hands its values over (colocated engines offloaded before it); with
   ``algorithm.off_policy_returns: vtrace`` the actor first scores the batch, alone on its devices,
   and the critic trains on V-trace's targets over those log-probs;
3. the critic sleeps, the actor trains with the critic's values;
4. save when due: the driver's state now, each role's from the host copies of its next sleep, written
   in the background while the loop goes on (``saving.py``; COMPLETE once every file is on disk);
5. update the engines' weights (the actor reconnects to the engines if it slept);
6. onload the engines, evaluate when due.

Every sleep and wake is the driver's, taken from ``OffloadPlan.transitions`` between phases; the
workers only carry them out. ``offload.overlap`` (``overlap.py``, decided right after start-up) runs
them in the background and wakes the next phase's roles ahead (``phases.py``). A critic-only
warm-up step (``train.num_critic_only_steps``) skips 3 and 5; a GRPO run has no critic and skips 2.
The step's timing and metrics, and the order of its phases (which roles wake ahead of which), are
kept by its record (``step_record.py``); the batch's staleness by the schedule (``schedule.py``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.console import Console

from ppo_driver import (
    budget,
    build,
    checkpoint,
    cluster_check,
    critic_report,
    nodes,
    preflight,
    processes,
    reaper,
    resume,
)
from ppo_driver.config import RunConfig, dump_config
from ppo_driver.faults import RunFailed, StopSignals
from ppo_driver.metrics import MetricsLog, StepProgress
from ppo_driver.overlap import OverlapChoice, choose_overlap
from ppo_driver.phases import PhaseTracker
from ppo_driver.ray_start import ray_session
from ppo_driver.roles import RoleFactory, Roles, TrainGroupLike, create_roles, role_names, shutdown_roles
from ppo_driver.runlock import RunLock
from ppo_driver.saving import CheckpointSaver
from ppo_driver.schedule import BatchSchedule, Cadence
from ppo_driver.startup import StartupClock, StartupTable, first_step_ratio
from ppo_driver.step_record import StepPlan, StepRecord, Where
from ppo_driver.stops import (
    check_space,
    report_failures,
    stop_at_once,
    stop_if_asked,
    where_to_resume,
)
from ppo_value_transport import pair_values

if TYPE_CHECKING:
    from ppo_rollout.manager import RolloutBatch
    from ppo_value_transport import Pieces


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
    startup: StartupTable | None = None  # the seconds from the command to the first step

    @property
    def weights_match(self) -> bool:
        return bool(self.engine_checksums) and all(c == self.actor_checksum for c in self.engine_checksums)


@dataclass
class Run:
    """What setup started, for the steps and the end of the run."""

    config: RunConfig
    run_dir: Path
    ckpt_root: Path
    roles: Roles
    phases: PhaseTracker
    saver: CheckpointSaver
    schedule: BatchSchedule
    log: MetricsLog
    progress: StepProgress
    signals: StopSignals
    where: Where
    overlap: OverlapChoice
    start: int  # the step setup resumed at (0: a fresh run)
    setup_metrics: dict[str, dict[str, float]]
    evaluates: Cadence
    published: int = 0  # the latest weight version sent to the engines
    startup: StartupTable | None = None  # set when setup ends: the first step starts

    @property
    def roles_in_budget(self) -> tuple[str, ...]:
        """The roles that sleep and wake, as the step budget names them."""
        return tuple(budget.budget_role(r) for r in self.phases.plan.roles)


def train(
    config: RunConfig,
    run_dir: Path,
    *,
    console: Console | None = None,
    roles_factory: RoleFactory = create_roles,
    startup: StartupClock | None = None,
    dataset_check: preflight.DatasetCheck | None = None,
) -> RunResult:
    """Run the loop. A failing step raises ``RunFailed`` (step, phase, cause, where a re-run resumes);
    SIGINT/SIGTERM raise ``Interrupted`` after a save at the end of the step they arrived in.
    ``startup``: the clock the start-up is timed on (the CLI's, from the process's start); else one
    from this call. ``dataset_check``: the dataset's pre-flight running alongside (``preflight.
    DatasetCheck``), waited for once the roles started; its ``ConfigError`` stops the run (before the
    roles start when it has failed by then)."""
    console = console or Console()
    # Absolute paths: the Ray workers that read the model and write checkpoints run in other folders.
    run_dir = run_dir.resolve()
    with ExitStack() as stack:
        run = setup(config, run_dir, stack, console, roles_factory, startup or StartupClock(), dataset_check)
        if isinstance(run, RunResult):
            return run  # already at train.steps: nothing was started
        if config.rollout.eval_before_train and run.start == 0:
            run.log.log(0, run.roles.rollout.evaluate(0))  # the curve's starting point
        for n in range(run.start + 1, config.train.steps + 1):
            metrics = step(run, n)
            run.log.log(n, metrics)
            run.progress.update(n, metrics)
            if run.signals.requested is not None and n < config.train.steps:
                # A safe point: the step is whole; saved (if it was not), the re-run loses nothing.
                with run.where.within("save"):
                    run.saver.maybe_save(n, last=True)
                    run.saver.wait()
                stop_if_asked(run.signals, n, run.ckpt_root)
        return finish(run)
    raise AssertionError("unreachable")  # ExitStack does not swallow exceptions


# --- the step ------------------------------------------------------------------------------------


def step(run: Run, n: int) -> dict[str, Any]:
    """Step ``n`` (the module docstring's 1-6); returns its metrics."""
    roles = run.roles
    plan = StepPlan(critic=roles.critic is not None, actor=n > run.config.train.num_critic_only_steps)
    rec = StepRecord(n, run.phases, run.saver, run.where, run.roles_in_budget, plan)
    batch = _generate(run, rec)
    values = _critic_trains(run, roles.critic, rec, batch) if roles.critic is not None else None
    if plan.actor:
        _actor_trains(roles.actor, rec, batch, values)
    last = n == run.config.train.steps or run.signals.requested is not None
    with rec.saving():
        saved = run.saver.maybe_save(n, last=last)  # the roles' files follow once they sleep
    with rec.part("generate_wait"):
        run.schedule.drain()  # the engines finish the next batch before their weights change
    if plan.actor:
        _update_weights(run, rec)
    # The engines back; the next step's first role woken ahead, unless a checkpoint still waits for
    # this step's sleeps (saving.py), or no step follows.
    rec.next_step(wake_ahead=not (last or saved))
    if run.evaluates.due(n):
        with rec.part("eval"):
            rec.add("eval", roles.rollout.evaluate(n))
    metrics = rec.finish(last=last)
    metrics.update(critic_report.cost_metrics(metrics))  # the critic's share of the step
    return metrics


def _generate(run: Run, rec: StepRecord) -> RolloutBatch:
    """The step's batch (generated now, or one step ahead), and the next one started when due."""
    with rec.phase("generate"):
        batch = run.schedule.batch(rec.step)
    rec.metrics.update(batch.metrics)
    rec.metrics.update(run.schedule.after_batch(rec.step, batch, run.published))
    return batch


def _critic_trains(run: Run, critic: TrainGroupLike, rec: StepRecord, batch: RolloutBatch) -> list[Pieces]:
    """The critic trains on its split of the batch and hands its values over to the actor's ranks."""
    with rec.phase("critic_train"):  # offloads colocated engines, wakes the critic
        vtrace = run.config.algorithm.off_policy_returns == "vtrace"
        result = critic.train(rec.step, batch.critic_boxes, _policy_log_probs(run, batch) if vtrace else None)
        rec.carve("handoff", result.metrics.get("handoff_put_s", 0.0))
    rec.trained("critic", result.metrics)
    if not result.values:
        raise RuntimeError(f"step {rec.step}: the critic returned no values for the actor")
    with rec.part("handoff"):
        # The critic's ranks may hold the samples in another split: rows go by sample id.
        values = pair_values(result.values, batch.critic_sample_ids, batch.sample_ids)
    rec.metrics["handoff/value_boxes"] = len(result.values)
    rec.handed_over(sum(max(box.nbytes, 0) for box in result.values))
    return values


def _policy_log_probs(run: Run, batch: RolloutBatch) -> list[Pieces]:
    """V-trace's target policy for the critic: the actor's log-probs of the batch before its update,
    scored with the actor alone on its devices (``PhaseTracker.alone``: with offload, the critic steps
    aside and the actor wakes for it), each critic rank's rows by sample id."""
    with run.phases.alone("actor"):
        boxes = run.roles.actor.policy_log_probs(batch.boxes)
    return pair_values(boxes, batch.sample_ids, batch.critic_sample_ids)


def _actor_trains(
    actor: TrainGroupLike, rec: StepRecord, batch: RolloutBatch, values: list[Pieces] | None
) -> None:
    """The actor trains on the batch, with the critic's values when there is a critic."""
    with rec.phase("actor_train"):  # the critic sleeps, the actor wakes
        result = actor.train(rec.step, batch.boxes, values)
        rec.carve("handoff", result.metrics.get("handoff_get_s", 0.0))
    rec.trained("actor", result.metrics)  # before the save and the weight update
    if values is not None:
        rec.metrics["handoff/values_used"] = 1


def _update_weights(run: Run, rec: StepRecord) -> None:
    with rec.phase("weight_update"):  # the actor reconnects to the engines if it slept
        rec.add("weight_sync", run.roles.actor.update_weights(version=str(rec.step)))
    run.published = rec.step
    if run.config.train.check_weights:
        with rec.part("check_weights"):
            check_weights_match(rec.step, run.roles, _check_rows(run.config))


def _check_rows(config: RunConfig) -> int | None:
    """The rows of each tensor an engine's weights checksum reads (SGLang reads its weights back as
    JSON: ``rollout.sglang.check_rows``); None: every row."""
    r = config.rollout
    return r.sglang.check_rows if r.engine == "sglang" else None


# --- setup -----------------------------------------------------------------------------------------


def setup(
    config: RunConfig,
    run_dir: Path,
    stack: ExitStack,
    console: Console,
    roles_factory: RoleFactory,
    clock: StartupClock,
    dataset_check: preflight.DatasetCheck | None = None,
) -> Run | RunResult:
    """Everything before the first step, each part timed on ``clock`` and its undoing on ``stack``; a
    ``RunResult`` when the run folder's checkpoint is at ``train.steps`` already (nothing started)."""
    ckpt_root = Path(config.checkpoint.dir).resolve() if config.checkpoint.dir else run_dir / "checkpoints"
    with clock.part("run folder"):
        stack.enter_context(RunLock(run_dir))  # creates run_dir; refuses a second run in it
        if not ckpt_root.is_relative_to(run_dir):  # a checkpoint.dir of its own: one run at a time too
            stack.enter_context(RunLock.checkpoints(ckpt_root, run_dir))
        # The content hashes of the checkpoints to resume from are checked while Ray and the roles start.
        verified = checkpoint.BackgroundVerify(ckpt_root) if config.checkpoint.resume else None
        done = resume.already_done(ckpt_root, verified, config.train.steps)
        if done is None:  # else decided before anything starts: the finished run's files stay as they are
            _prepare_folder(config, run_dir, ckpt_root, console)
    if done is not None:
        return _nothing_to_do(config, run_dir, done, console)
    where = Where()
    signals, model_path = _ray_and_model(config, run_dir, ckpt_root, where, stack, console, clock)
    if config.ray.address:  # a cluster: every node must see the run's folders (cluster_check.py)
        with clock.part("shared folders"):
            cluster_check.check(config, run_dir, ckpt_root, model_path, config.ray.timeout_s)
    # After the model: its build forks and restores torch's global generator (ppo_rollout.tasks).
    seed_everything(config.train.seed)
    if dataset_check is not None:
        dataset_check.raise_if_failed()  # a bad prompt found while Ray started: no roles started
    roles = _start_roles(config, run_dir, model_path, stack, console, roles_factory, clock, dataset_check)
    with clock.part("offload plan"):
        phases, saver, overlap = _turn_taking(config, roles, run_dir, ckpt_root, where, stack, console)
    start = 0
    if verified is not None:
        # Resume: model, optimizer, critic, step, RNG and data position from the latest checkpoint that
        # loads (one that does not is reported and skipped for the previous one).
        where.phase = "resume"
        with clock.part("resume"):
            start = resume.resume(ckpt_root, verified, roles, phases.enter, config, console)
    setup_metrics = _first_weight_update(roles, phases, where, start, clock)
    run = Run(
        config=config,
        run_dir=run_dir,
        ckpt_root=ckpt_root,
        roles=roles,
        phases=phases,
        saver=saver,
        schedule=_schedule(config, roles, saver, stack),
        log=_metrics_log(config, run_dir, start, stack),
        progress=stack.enter_context(
            StepProgress(config.train.steps, start, console=console, enabled=config.logging.progress)
        ),
        signals=signals,
        where=where,
        overlap=overlap,
        start=start,
        setup_metrics=setup_metrics,
        evaluates=Cadence(config.rollout.eval_interval, config.train.steps, final=True),
        published=start,
    )
    stop_if_asked(signals, start, ckpt_root)
    run.startup = clock.end()
    return run


def _nothing_to_do(config: RunConfig, run_dir: Path, done: tuple[int, Path], console: Console) -> RunResult:
    console.print(
        f"nothing to do: {done[1]} is at step {done[0]} >= train.steps={config.train.steps}; "
        f"the run's files are as it left them (raise train.steps to train on, or set "
        "checkpoint.resume=false to start over)",
        highlight=False,
    )
    return RunResult(run_dir, first_step=done[0] + 1, last_step=done[0], finished_at=done[1])


def _prepare_folder(config: RunConfig, run_dir: Path, ckpt_root: Path, console: Console) -> None:
    if not config.checkpoint.resume:
        resume.start_over(run_dir, ckpt_root, console)
    (run_dir / "config.yaml").write_text(dump_config(config))
    checkpoint.remove_unfinished(ckpt_root)  # saves a failed or killed run never completed
    check_space(config, ckpt_root)  # a save that cannot fit fails now, not minutes into the run


def _ray_and_model(
    config: RunConfig,
    run_dir: Path,
    ckpt_root: Path,
    where: Where,
    stack: ExitStack,
    console: Console,
    clock: StartupClock,
) -> tuple[StopSignals, Path]:
    """Ray, and meanwhile the model folder (the tiny model: transformers' import, the build, the
    files), since Ray's start-up mostly waits for its processes. Failures are reported from here on."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-path") as pool:
        model = pool.submit(_timed, _model_path, config, run_dir)
        with clock.part("ray"):
            signals = _start_ray(config, ckpt_root, where, stack, console)
        # Entered before the roles: their shutdown runs first, then a failure is reported.
        stack.enter_context(report_failures(where, ckpt_root, run_dir))
        with clock.part("model path (after ray)"):
            model_path, model_s = model.result()
    clock.alongside("ray", "tiny model" if config.model.path is None else "model path", model_s)
    return signals, model_path


def _start_ray(
    config: RunConfig, ckpt_root: Path, where: Where, stack: ExitStack, console: Console
) -> StopSignals:
    """Ray (joined or started), then the stop signals: a second one ends every process the run
    started, which are the ones that were not there before."""
    spared = set(reaper.descendants(os.getpid()))  # not the run's: a second Ctrl-C leaves them be
    try:
        stack.enter_context(ray_session(config, console))
    except Exception as exc:  # Ray did not start (twice, for a local instance): one line, as any stop
        raise RunFailed(0, "setup", exc, where_to_resume(ckpt_root)) from exc
    return stack.enter_context(
        StopSignals(on_second=lambda signum: stop_at_once(signum, where, ckpt_root, spared))
    )


def _start_roles(
    config: RunConfig,
    run_dir: Path,
    model_path: Path,
    stack: ExitStack,
    console: Console,
    roles_factory: RoleFactory,
    clock: StartupClock,
    dataset_check: preflight.DatasetCheck | None,
) -> Roles:
    # The roles' start-up (processes importing torch, loading the model) is most of a short run's
    # time: say what is starting, and how long it took, rather than staying silent through it.
    console.print(f"starting {role_names(config)} ...", highlight=False)
    with clock.part("roles"):
        starting = time.perf_counter()
        roles = roles_factory(config, model_path, config.ray.timeout_s)
        stack.callback(shutdown_roles, roles)
    console.print(f"started in {time.perf_counter() - starting:.1f} s", highlight=False)
    clock.roles(roles.startup)
    if dataset_check is not None:
        with clock.part("dataset check (after roles)"):
            checked = dataset_check.result()
        if checked is not None:
            console.print(f"dataset: {checked}", highlight=False)
    _finish_warm_up(roles, clock)  # before anything else asks the workers (they answer in turn)
    with clock.part("processes.json"):
        processes.record(roles, run_dir, config.ray.timeout_s)
    with clock.part("nodes.json"):
        placed = nodes.record(roles, run_dir, config.ray.timeout_s, console)
    stack.enter_context(nodes.name_lost_nodes(placed))  # a lost node is named in the run's stop
    return roles


WARM_UP = "warm-up (after roles)"


def _finish_warm_up(roles: Roles, clock: StartupClock) -> None:
    """Wait for the warm-ups the roles started as each was made (``startup.warm_up``): the row is what
    the driver still waited once the roles were up, the detail each role's own warm-up. Before the
    offload plan, which measures the GPUs' free memory, and before any role sleeps."""
    if not roles.warming:
        return
    with clock.part(WARM_UP):
        for name, wait in roles.warming.items():
            clock.alongside(WARM_UP, name, wait()["warm_up_s"])


def _turn_taking(
    config: RunConfig,
    roles: Roles,
    run_dir: Path,
    ckpt_root: Path,
    where: Where,
    stack: ExitStack,
    console: Console,
) -> tuple[PhaseTracker, CheckpointSaver, OverlapChoice]:
    """The phase tracker that moves the roles, in the order ``offload.overlap`` picks, and the saver."""
    overlap = _choose_overlap(config, roles)  # measured now, with every role resident
    console.print(overlap.describe(), highlight=False)
    plan = build.offload_plan(config)
    timeout_s = config.ray.timeout_s
    phases = PhaseTracker(plan, roles, on_enter=where.entering, overlap=overlap.overlap, timeout_s=timeout_s)
    stack.callback(phases.close)  # before the roles shut down: nothing left moving
    saver = CheckpointSaver(
        ckpt_root,
        roles,
        phases,
        lambda step: resume.driver_state(step, roles, config, run_dir),
        keep=config.checkpoint.keep,
        cadence=Cadence(config.checkpoint.interval, config.train.steps, final=config.checkpoint.save_final),
    )
    return phases, saver, overlap


def _first_weight_update(
    roles: Roles, phases: PhaseTracker, where: Where, start: int, clock: StartupClock
) -> dict[str, dict[str, float]]:
    """The engines start from the actor's weights (the loaded ones on resume); returns what start-up
    moved (its sleeps, wakes and this update), which is no step's budget."""
    where.step = start
    with clock.part("weight-sync connect"):
        phases.enter("weight_update")
        roles.actor.connect_engines(roles.rollout.endpoints())
    with clock.part("first weight update"):
        roles.actor.update_weights(version=str(start))
        phases.enter("generate")
        phases.settle()
    return phases.pop_role_metrics()


def _metrics_log(config: RunConfig, run_dir: Path, start: int, stack: ExitStack) -> MetricsLog:
    log = MetricsLog(run_dir, tensorboard=config.logging.tensorboard, start_step=start)
    stack.callback(log.close)
    return log


def _schedule(config: RunConfig, roles: Roles, saver: CheckpointSaver, stack: ExitStack) -> BatchSchedule:
    # train.async=one_step_off: step t + 1's batch is generated while step t trains (schedule.py).
    schedule = BatchSchedule(
        roles.rollout,
        config.train.async_,
        last_step=config.train.steps,
        saves_at=saver.cadence.due,
        timeout_s=config.ray.timeout_s,
        max_staleness=_max_staleness(config),
    )
    stack.callback(schedule.close)
    return schedule


def _max_staleness(config: RunConfig) -> int:
    """How many versions behind the published weights a batch's oldest token may be."""
    partial = config.rollout.partial
    return partial.max_staleness if partial.enabled else 1


# --- the end ---------------------------------------------------------------------------------------


def finish(run: Run) -> RunResult:
    """Wait for the last checkpoint and every transition, compare the actor's and the engines'
    weights, write ``summary.json``."""
    with run.where.within("save"):
        run.saver.wait()
    run.phases.settle()
    config = run.config
    result = RunResult(
        run_dir=run.run_dir,
        first_step=run.start + 1,
        last_step=max(run.start, config.train.steps),
        history=run.log.history,
        # the engines' checksum covers the rows they read back (SGLang's check_rows): the actor's the same
        actor_checksum=run.roles.actor.weights_checksum(_check_rows(config)),
        engine_checksums=list(run.roles.rollout.weights_checksums()),
        startup=run.startup,
    )
    summary = {
        "first_step": result.first_step,
        "last_step": result.last_step,
        "actor_checksum": result.actor_checksum,
        "engine_checksums": result.engine_checksums,
        "weights_match": result.weights_match,
        "budget": budget.summary(run.log.history),
        "setup": run.setup_metrics,
        "startup": run.startup.summary() if run.startup is not None else None,
        # The first step's seconds and their ratio to the mean step after it (what start-up left to it).
        "first_step_time": _first_step_time(run.log.history),
        "transitions": {"overlap": run.overlap.overlap, "reason": run.overlap.reason},
        # What the critic cost and bought over the last steps (null without a critic).
        "critic": critic_report.summary(run.log.history),
    }
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return result


# --- helpers ---------------------------------------------------------------------------------------


def _first_step_time(history: list[dict[str, Any]]) -> dict[str, float] | None:
    first = first_step_ratio(history)
    return None if first is None else {"seconds": first[0], "over_steady": first[1]}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_weights_match(step: int, roles: Roles, rows: int | None = None) -> None:
    """Every engine holds the actor's weights (``train.check_weights``, after each update); ``rows``:
    each tensor's first rows only, on both sides (``rollout.sglang.check_rows``)."""
    # The engines hash their weights while the actor hashes its own (each is seconds at 1B parameters).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="check-weights") as pool:
        on_engines = pool.submit(roles.rollout.weights_checksums)
        actor = roles.actor.weights_checksum(rows)
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


def _timed(make: Callable[[RunConfig, Path], Path], config: RunConfig, run_dir: Path) -> tuple[Path, float]:
    t0 = time.perf_counter()
    return make(config, run_dir), time.perf_counter() - t0


def _model_path(config: RunConfig, run_dir: Path) -> Path:
    if config.model.path is not None:
        # The rollout manager loads the model's tokenizer in this process: transformers' import (about
        # 3 s of CPU) goes here, alongside Ray's start, instead of on the roles' start.
        from transformers import AutoTokenizer  # noqa: F401

        local = Path(config.model.path).expanduser()
        return local.resolve() if local.exists() else local  # else a name the workers resolve
    if config.rollout.task is None:
        raise ValueError("model.path is null (the built-in tiny model) but rollout.task is not set")
    from transformers.utils import logging as hf_logging

    from ppo_rollout.tasks import make_tiny_model

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
