"""``ppo-driver``: train, validate a config, plot a run, write a run's report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from rich.console import Console, RenderableType
from rich.markup import escape

from ppo_driver import __version__, preflight, resume_checks
from ppo_driver.config import ConfigError, RunConfig, dump_config, load_config
from ppo_driver.startup import StartupClock

DESCRIPTION = """\
PPO post-training for LLMs: actor and critic share the training devices by taking turns,
rollout engines generate, new actor weights are broadcast to the engines each step.

With no config, `ppo-driver train` runs the embedded default: a tiny model learning a built-in
task on CPU under a local Ray instance, in a few minutes."""

EPILOG = """\
examples:
  ppo-driver train                                  # the embedded CPU default, run folder runs/<time>
  ppo-driver train --run-dir runs/demo --set train.steps=10
  ppo-driver train --config configs/2gpu-colocate.yaml
  ppo-driver train --config my.yaml --ray-address auto   # join a running Ray cluster
  ppo-driver validate configs/2gpu-disaggregate.yaml
  ppo-driver plot runs/demo                         # writes runs/demo/curves.png
  ppo-driver report runs/demo                       # writes runs/demo/report.html (one page, offline)
  ppo-driver import-model model.gguf models/my-model   # a GGUF file or HF folder -> model.path

--set takes dotted names and YAML values: --set algorithm.estimator=grpo --set placement.critic=none
Config sections: model, placement, rollout, algorithm, train, offload, checkpoint, logging, ray, startup;
every field with its default: ppo-driver validate configs/cpu-default.yaml
A run folder that holds a complete checkpoint resumes from it (checkpoint.resume=false starts over)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppo-driver",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ppo-driver {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_train(sub)
    _add_validate(sub)
    _add_plot(sub)
    _add_report(sub)
    _add_import_model(sub)
    return parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field, e.g. --set train.steps=10 (repeatable; YAML values)",
    )


def _add_train(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = sub.add_parser(
        "train",
        help="run PPO training",
        description="Run PPO training; prints progress per step and a summary at the end.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Files in the run folder: config.yaml, metrics.jsonl, summary.json, checkpoints/, "
        "tensorboard/ (when tensorboard is installed), model/ (the built-in tiny model).",
    )
    train.add_argument(
        "--config", type=Path, metavar="FILE", help="YAML config (default: the embedded CPU default)"
    )
    _add_config_args(train)
    train.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="join an existing Ray cluster (e.g. 'auto' or 'ray://host:10001') instead of starting one",
    )
    train.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="run folder for metrics and checkpoints (default: logging.run_dir, else runs/<date-time>)",
    )


def _add_validate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    validate = sub.add_parser(
        "validate",
        help="check a config; print it resolved, and the placement layout",
        description="Validate CONFIG (plus --set overrides) without starting anything; print the "
        "resolved config and the placement layout. Exit code 2 on an invalid config.",
    )
    validate.add_argument("config", type=Path, metavar="CONFIG", help="YAML config file")
    _add_config_args(validate)


def _add_plot(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plot = sub.add_parser(
        "plot",
        help="plot reward, loss, KL and step time of a run to a PNG",
        description="Read RUN_DIR/metrics.jsonl and write the curves as a PNG.",
    )
    plot.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder written by `train`")
    plot.add_argument("-o", "--output", type=Path, help="PNG path (default: RUN_DIR/curves.png)")


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = sub.add_parser(
        "report",
        help="write a run's report: one HTML page of its curves, critic, budget and settings",
        description="Read RUN_DIR (metrics.jsonl; config.yaml and summary.json when there) and write one "
        "self-contained HTML page: reward and held-out accuracy, the critic's health and cost, its "
        "advantages against GRPO's and RLOO's, the step budget. It opens from disk with no server or "
        "network. Exit code 2 when RUN_DIR holds no steps.",
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder written by `train`")
    report.add_argument("--out", type=Path, metavar="FILE", help="HTML path (default: RUN_DIR/report.html)")


def _add_import_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    imp = sub.add_parser(
        "import-model",
        help="turn a GGUF file or a Hugging Face folder into a model folder a run loads",
        description="Write SRC (a .gguf file, a folder holding one, or a Hugging Face model folder) to OUT "
        "as safetensors with its config, tokenizer, chat template and generation config, then check "
        "that the actor, the critic and the built-in engine load it. Nothing is downloaded. Use OUT as "
        "model.path.",
    )
    imp.add_argument("src", type=Path, metavar="SRC", help="a .gguf file or a Hugging Face model folder")
    imp.add_argument("out", type=Path, metavar="OUT", help="the model folder to write (must not exist)")
    imp.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights as saved (default float32; training loads float32 either way)",
    )
    imp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    imp.add_argument("--no-check", action="store_true", help="skip loading it as actor, critic and engine")


def main(argv: Sequence[str] | None = None) -> int:
    # The start-up table counts from the process's start: the interpreter and the imports so far too.
    startup = StartupClock.since_process_start()
    startup.since_origin("python start + imports")
    # Under `uv run`, Ray 2.60 re-launches every worker through `uv run` with the working directory
    # packaged as a runtime env: slow, and unneeded since the workers run in this environment (and every
    # node of a cluster has the workspace installed, as docs/guide/cluster.md says). Ray reads the
    # switch when it is first imported, which loading the config does, so it is set here; exporting it
    # overrides this.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    args = build_parser().parse_args(argv)
    if args.command == "train" and not _joins_cluster(args):
        # A one-machine run: Ray's single-node mode takes 127.0.0.1 as the node's address, and its GCS
        # server, raylet and workers then listen on it alone (else on every interface). Read when Ray
        # is first imported, so set here too; exporting RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 opts out.
        os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
    console = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    try:
        if args.command == "train":
            return _train(args, console, startup)
        if args.command == "validate":
            return _validate(args, console)
        if args.command == "import-model":
            return _import_model(args, console)
        if args.command == "plot":
            from ppo_driver.plot import plot_run

            path = plot_run(args.run_dir, args.output)
            console.print(f"wrote {path}", highlight=False)
            return 0
        if args.command == "report":
            return _report(args, console, err)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: no safe point was awaited
        err.print(
            "stopped at once; a re-run of the same command resumes from the latest complete checkpoint",
            highlight=False,
        )
        return 130
    except Exception as exc:
        from ppo_driver.faults import Interrupted, RunFailed
        from ppo_driver.runlock import RunLockError

        if isinstance(exc, Interrupted):  # one line, no traceback: the user asked for the stop
            err.print(f"{exc}", highlight=False, markup=False)
            return 128 + exc.signum
        if isinstance(exc, RunFailed | RunLockError):
            where = ""
            if isinstance(exc, RunFailed) and exc.traceback_file is not None:
                where = f" (traceback: {exc.traceback_file})"
            err.print(f"[bold red]error:[/] {escape(str(exc) + where)}", highlight=False)
            return 1
        if isinstance(exc, FileNotFoundError | ValueError) and args.command != "train":
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            return 1
        raise
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown ones


# Ray's switch for multi-node clusters (named for the platforms where it is off by default): off,
# a local instance takes 127.0.0.1 as its node address and binds its servers there.
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _joins_cluster(args: argparse.Namespace) -> bool:
    """Whether ``train`` joins a Ray cluster (``--ray-address`` or ``ray.address``), read without
    importing Ray; a config that does not parse counts as local (``resolve`` reports it)."""
    if args.ray_address:
        return True
    from ppo_driver.config import apply_overrides, read_yaml

    try:
        data = apply_overrides(read_yaml(args.config) if args.config is not None else {}, args.overrides)
    except (ConfigError, OSError, ValueError):
        return False
    section = data.get("ray")
    return isinstance(section, dict) and bool(section.get("address"))


def resolve(args: argparse.Namespace) -> RunConfig:
    """The config of ``train``/``validate``: file, then --set, then the CLI's own flags."""
    overrides = list(args.overrides)
    if getattr(args, "ray_address", None):
        overrides.append(f"ray.address={json.dumps(args.ray_address)}")  # a JSON string is YAML
    if getattr(args, "run_dir", None):
        overrides.append(f"logging.run_dir={json.dumps(str(args.run_dir))}")
    if args.config is not None:
        preflight.check_yaml_file(args.config)  # duplicate keys, which load_config cannot see
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(args.config, overrides)
    for w in caught:
        Console(stderr=True, soft_wrap=True).print(
            f"[yellow]warning:[/] {escape(str(w.message))}", highlight=False
        )
    return config


def _print_warnings(warned: Sequence[str]) -> None:
    err = Console(stderr=True, soft_wrap=True)
    for line in warned:
        err.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)


def _checkpoint_root(config: RunConfig, run_dir: Path) -> Path:
    """Where the run keeps its checkpoints (``loop.setup``'s rule)."""
    return Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"


def _validate(args: argparse.Namespace, console: Console) -> int:
    config = resolve(args)
    run_dir = Path(config.logging.run_dir) if config.logging.run_dir else None
    _print_warnings(preflight.check(config, run_dir=run_dir))
    checked = preflight.check_dataset(config)
    console.print(dump_config(config), highlight=False, markup=False)
    if checked is not None:
        console.print(f"dataset: {checked}", highlight=False)
    console.print(describe_layout(config), highlight=False, markup=False)
    console.print("config OK", style="bold green")
    return 0


def describe_layout(config: RunConfig) -> str:
    """The placement layout as text: bundles, each role's bundles and device share, the offload plan."""
    from ppo_driver import build
    from ppo_placement import plan_layout

    spec = build.placement_spec(config)
    layout = plan_layout(spec)
    unit = "GPU" if spec.use_gpus else "CPU bundle"
    lines = [
        "placement layout:",
        f"  mode={config.placement.mode} device={config.placement.device} "
        f"critic={config.placement.critic} bundles={layout.num_bundles} ({unit}s) "
        f"engines={layout.engine_count} x {spec.gpus_per_engine} {unit}",
    ]
    for role, part in layout.roles.items():
        lines.append(
            f"  {role:<8} bundles [{part.offset}, {part.offset + part.count}) "
            f"gpu_share={part.gpu_share:g} cpu_share={part.cpu_share:g}"
        )
    try:
        plan = build.offload_plan(config)
    except ImportError:  # the lifecycle package is not installed
        return "\n".join(lines)
    lines.append("offload plan (resident roles per phase):")
    for phase in ("generate", "critic_train", "actor_train", "save", "weight_update"):
        lines.append(f"  {phase:<14} {', '.join(sorted(plan.resident(phase))) or '-'}")
    return "\n".join(lines)


def _report(args: argparse.Namespace, console: Console, err: Console) -> int:
    from ppo_driver.report import ReportError, load_run, write_report

    try:
        run = load_run(args.run_dir)
        path = write_report(run, args.out)
    except ReportError as exc:  # one line naming the path and the fix
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    for note in run.notes:
        err.print(f"[yellow]warning:[/] {escape(note)}", highlight=False)
    console.print(f"wrote {path} ({len(run.records)} steps); open it in a browser", highlight=False)
    return 0


def _import_model(args: argparse.Namespace, console: Console) -> int:
    from ppo_driver.import_model import import_model

    report = import_model(args.src, args.out, dtype=args.dtype, force=args.force, check=not args.no_check)
    src = report.source
    what = f"GGUF {src.folder / (src.gguf_file or '')}" if src.kind == "gguf" else f"folder {src.folder}"
    console.print(
        f"imported {what} -> {report.out} ({report.parameters / 1e6:.1f}M parameters, {report.dtype}, "
        f"chat template: {'yes' if report.chat_template else 'no'})",
        highlight=False,
    )
    console.print(_family_line(report.family), highlight=False)
    if report.check is not None:
        check = report.check
        console.print(
            f"checked: the actor, the critic (values {check.critic_values_shape}) and the built-in engine "
            f"load it; eos token ids {list(check.eos_token_ids)}; greedy answer to "
            f"{check.prompt!r}: {check.answer!r}",
            highlight=False,
        )
    console.print(f"use it with: --set model.path={report.out}", highlight=False)
    return 0


def _family_line(name: str | None) -> str:
    """What the paths that know model families (``ppo_weight_sync.families``) do with this one."""
    from ppo_weight_sync.families import FAMILIES

    family = next((f for f in FAMILIES if f.name == name), None)
    if family is None:
        return (
            "model family: not in the family table (the torch backend and the engines' decode loop take "
            "it; the built-in engine's static decoder and the megatron backend do not)"
        )
    fast = "yes" if family.decoder is not None else "no (the decode loop)"
    megatron = "yes" if family.megatron is not None else "no (use train.backend: torch)"
    return (
        f"model family: {family.name} (built-in engine's static decoder: {fast}; "
        f"megatron backend: {megatron})"
    )


def print_whole(console: Console, table: RenderableType) -> None:
    """A table at its natural width: Rich fits a table to the console, 80 columns when the output is
    not a terminal (``tee``, ``nohup``, CI logs), which cut the column names short."""
    from rich.measure import Measurement

    if console.is_terminal:
        console.print(table)
        return
    width = Measurement.get(console, console.options.update_width(100_000), table).maximum
    if width <= console.width:
        console.print(table)
        return
    wide = Console(
        file=console.file, width=width, soft_wrap=True, force_terminal=False, no_color=console.no_color
    )
    wide.print(table)


ERROR_LOG = "error.log"


def _write_traceback(exc: BaseException, run_dir: Path) -> Path | None:
    """The failure's whole traceback (the workers' included, as Ray passes them on) into the run
    folder, for a bug report; the terminal gets the one-line report. None if it cannot be written."""
    import traceback

    path = run_dir.resolve() / ERROR_LOG
    try:
        with path.open("a") as f:
            f.write(f"--- {datetime.now().isoformat(timespec='seconds')}\n")
            f.write("".join(traceback.format_exception(exc)))
    except OSError:  # a full disk, say: the report on the terminal is what matters
        return None
    return path


def _train(args: argparse.Namespace, console: Console, startup: StartupClock) -> int:
    with startup.part("config + pre-flight"):
        config = resolve(args)
        if config.ray.write_bytecode:  # before the heavy imports: the next start reads the caches
            sys.dont_write_bytecode = False
        logging.basicConfig(level=config.logging.level, format="%(levelname)s %(name)s: %(message)s")
        run_dir = Path(config.logging.run_dir or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
        warned = preflight.check(config, run_dir=run_dir)  # before the run folder exists and Ray starts
        from ppo_rollout import env_errors

        env_errors.set_log_path(run_dir.resolve() / env_errors.LOG_NAME)  # on_env_error: zero's log
        preflight.check_devices(config)  # a local cuda run's GPUs, counted before Ray waits for them
        preflight.check_ray_address(config)  # a cluster to join answers at its address
        # What resuming from the run's checkpoint folder would mix (another run, model, data, lr).
        resume_checks.check(config, run_dir, _checkpoint_root(config, run_dir))
        _print_warnings(warned)
    with startup.part("driver imports"):  # torch, Ray, transformers
        from ppo_driver.faults import RunFailed
        from ppo_driver.loop import train
        from ppo_driver.metrics import budget_table, startup_table, summary_table

        if config.rollout.dataset is not None and config.model.path is not None:
            # Here, not in the check's thread: two threads importing torch's modules at once can
            # deadlock on the import locks.
            from transformers import AutoTokenizer  # noqa: F401
    # Every prompt, tokenized as the run will, while Ray and the roles start (the run stops before its
    # first step on a prompt it would fail on).
    dataset_check = preflight.DatasetCheck(config) if config.rollout.dataset is not None else None

    from ppo_driver.latest_link import point_latest

    point_latest(run_dir)  # runs/latest: the guides' next commands find this run
    console.print(
        f"ppo-driver {__version__}: {config.algorithm.estimator} on "
        f"{config.model.path or 'the built-in tiny model'} "
        f"({config.rollout.task or config.rollout.dataset}), {config.train.steps} steps, "
        f"{config.placement.mode} on {config.placement.device}; run folder {run_dir}",
        highlight=False,
    )
    from ppo_rollout.data import describe_eval_source

    if config.rollout.eval_prompts:
        console.print(f"evaluation prompts: {describe_eval_source(config.rollout)}", highlight=False)
    err = Console(stderr=True, soft_wrap=True)

    def show_warning(message: Warning | str, *_: object, **__: object) -> None:
        err.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False)

    with warnings.catch_warnings():
        warnings.showwarning = show_warning  # one line per warning, as the config's warnings
        try:
            result = train(
                config,
                run_dir,
                console=console,
                startup=startup,
                dataset_check=dataset_check,
            )
        except RunFailed as exc:
            exc.traceback_file = _write_traceback(exc, run_dir)
            raise
    if result.finished_at is not None:  # already at train.steps: nothing ran, nothing to compare
        return 0
    if result.history:
        print_whole(console, summary_table(result.history, run_dir))
        print_whole(console, budget_table(result.history, config.placement.device))
    if result.startup is not None:
        print_whole(console, startup_table(result.startup, result.history, config.placement.device))
    status = "match" if result.weights_match else "DIFFER"
    console.print(
        f"engines hold the actor's final weights: {status} (actor {result.actor_checksum[:12]})",
        highlight=False,
    )
    return 0 if result.weights_match else 1


if __name__ == "__main__":
    sys.exit(main())
