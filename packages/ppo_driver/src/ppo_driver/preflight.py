"""Checks of a validated config that need no Ray and no GPU, run by ``validate`` and by ``train``
before the run folder is created or Ray starts: a bad input stops here, with exit code 2 and the
field named, instead of minutes later inside a Ray worker.

- the YAML file has no duplicate keys (``train:`` twice would silently drop the first section);
- ``rollout.reward``: a ``module:function`` that imports and names a callable, or a registered name;
- ``model.path``: a local model folder (or a Hugging Face id already in the local cache);
- ``rollout.dataset``: exists, and every line is a JSON object holding ``rollout.prompt_field`` (the
  run's reader, ``ppo_rollout.data.JsonlPrompts``); then (``check_dataset``) every prompt tokenized
  with the run's tokenizer fits ``rollout.max_prompt_length`` and, with ``max_new_tokens``, the
  model's ``max_position_embeddings`` (``ppo_rollout.prompts``): ``validate`` waits for it, ``train``
  runs it alongside Ray's and the roles' start (``DatasetCheck``) and stops before the first step;
- ``train.backend='megatron'``: CUDA, Python >= 3.12, megatron-core importable, and
  ``train.tensor_parallel`` dividing each role's GPUs and the model's heads (ppo-trainer's rules);
- ``train.lora``: ``target_modules`` against the model's linear layers, and on CPU ``/dev/shm``'s room
  for a shared base (``model_preflight``, on a meta-device build of the model);
- ``train.critic_init_from``: a value model whose tensors' names and shapes (its safetensors headers)
  fit the critic of ``model.path`` (``ppo_trainer.critic_init``), the first mismatch named;
- the run folder and the checkpoint folder can be created and written (and, to start over with
  ``checkpoint.resume=false``, the checkpoint folder's parent).

This module reads the config and changes nothing; only ``check_dataset`` imports transformers (to
tokenize), when it is called.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import yaml

from ppo_driver.config import ConfigError, RunConfig
from ppo_driver.grpc_probe import answers_http2

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last silently)."""


def _construct_unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1} (first at line "
                f"{seen[key]}) of {key_node.start_mark.name}: the second would silently replace the "
                "first; merge the two into one"
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_unique_mapping,
)


def check_yaml_file(path: Path) -> None:
    """Refuse duplicate keys in a config file (other YAML errors are reported by ``load_config``)."""
    if not path.is_file():
        return
    try:
        yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except yaml.YAMLError:
        return


def check(config: RunConfig, *, run_dir: Path | None = None) -> list[str]:
    """Raise ``ConfigError`` listing every problem found; ``run_dir`` also checks the folders. Returns
    the warnings (one line each) of a config that passes."""
    from ppo_driver.model_preflight import lora_problems

    data_problems, warnings = _dataset(config)
    model_problems = _model(config)
    problems = [
        *_reward(config),
        *_rollout_parts(config),
        *_multi_turn(config),
        *model_problems,
        *([] if model_problems else lora_problems(config)),
        *([] if model_problems else _critic_init(config)),
        *data_problems,
        *_backend(config),
    ]
    if run_dir is not None:
        problems += _writable("--run-dir / logging.run_dir", run_dir)
        if config.checkpoint.dir:
            problems += _writable("checkpoint.dir", Path(config.checkpoint.dir))
            problems += _checkpoint_parent(config, Path(config.checkpoint.dir))
    if problems:
        n = len(problems)
        raise ConfigError(
            f"invalid config ({n} error{'s' if n > 1 else ''}):\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return warnings


def _critic_init(config: RunConfig) -> list[str]:
    """``train.critic_init_from``: a value model whose tensors (read from the safetensors headers, no
    weights) fit the critic of ``model.path``, built on the meta device (``ppo_trainer.critic_init``)."""
    if config.train.critic_init_from is None or not config.use_critic:
        return []
    from ppo_driver.model_preflight import _model_config
    from ppo_trainer import critic_init

    model_config = _model_config(config)
    if model_config is None:  # a Hub id: the trainer checks the source against it
        return []
    found = critic_init.problem(config.train.critic_init_from, model_config)
    return [] if found is None else [found]


def _reward(config: RunConfig) -> list[str]:
    spec = config.rollout.reward
    if spec is None:
        if config.rollout.dataset is not None:
            return [
                "rollout.reward is required with rollout.dataset: "
                "a registered name or 'package.module:function'"
            ]
        return []
    if ":" not in spec:
        from ppo_rollout.rewards import registered_rewards

        if spec not in registered_rewards():
            return [
                f"rollout.reward={spec!r} is not a registered reward ({', '.join(registered_rewards())}); "
                "use one of them or 'package.module:function'"
            ]
        return []
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        return [f"rollout.reward={spec!r}: write 'package.module:function'"]
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error, or whatever the module raises while importing
        return [
            f"rollout.reward={spec!r}: module {module_name!r} does not import ({type(exc).__name__}: {exc}); "
            "check the name and that the module is installed or on PYTHONPATH"
        ]
    fn = getattr(module, attr, None)
    if fn is None:
        return [f"rollout.reward={spec!r}: module {module_name!r} has no {attr!r}; check the function's name"]
    if not callable(fn):
        return [
            f"rollout.reward={spec!r}: {attr!r} in {module_name!r} is a {type(fn).__name__}, not a function"
        ]
    return []


def _rollout_parts(config: RunConfig) -> list[str]:
    """The multi-turn environment and the rollout function import (``module:name`` or built-in)."""
    from ppo_rollout.environment import resolve_environment
    from ppo_rollout.rollout_fns import resolve_rollout_function

    r = config.rollout
    problems = []
    for field, spec, resolve in (
        ("rollout.environment", r.resolved_environment, resolve_environment),
        ("rollout.rollout_function", r.resolved_rollout_function, resolve_rollout_function),
    ):
        try:
            if spec is not None:
                resolve(spec)
        except ValueError as exc:
            problems.append(f"{exc}; check the name and that the module is installed or on PYTHONPATH")
        except Exception as exc:  # whatever the module raises while importing
            problems.append(f"{field}={spec!r}: {type(exc).__name__} while importing: {exc}")
    return problems


def _multi_turn(config: RunConfig) -> list[str]:
    """The truncation marker fits the observation limit (a token spans at least one character, and the
    built-in tiny model's tokenizer writes one per character: a marker of as many characters as the
    limit cannot fit; ``ObservationRenderer`` checks the exact count at start)."""
    r = config.rollout
    if r.resolved_rollout_function == "single_turn":
        return []
    limits = r.multi_turn
    if len(limits.truncation_marker) < limits.max_observation_tokens or config.model.path is not None:
        return []
    return [
        f"rollout.multi_turn.truncation_marker ({len(limits.truncation_marker)} characters, as many tokens "
        f"with the built-in tiny model) does not fit rollout.multi_turn.max_observation_tokens "
        f"({limits.max_observation_tokens}); shorten the marker or raise the limit"
    ]


def _model(config: RunConfig) -> list[str]:
    path = config.model.path
    if path is None:
        return []
    local = Path(path).expanduser()
    if local.is_dir():
        return _model_folder(path, local)
    if local.exists():
        return [f"model.path={path!r} is a file; point it at the Hugging Face model folder that holds it"]
    if _HUB_ID.match(path) and not _looks_local(path) and not path.startswith("models/"):
        if _in_hub_cache(path):
            return []
        return [
            f"model.path={path!r} does not exist; set it to a local Hugging Face model folder (download "
            f"one with `hf download {path} --local-dir DIR`, or make one from a GGUF file with "
            "`ppo-driver import-model FILE.gguf DIR`), or to null for the built-in tiny model"
        ]
    return [
        f"model.path={path!r} does not exist (no folder {local.absolute()}); make it with `ppo-driver "
        f"import-model SRC {path}` (SRC: a .gguf file or a Hugging Face folder; docs/guide/real-model.md "
        "shows how), or set model.path to an existing model folder, or to null for the built-in tiny model"
    ]


def _looks_local(path: str) -> bool:
    """A path meant as a folder on this machine, not a hub id: it starts at ``/``, ``.`` or ``~``, or
    its first part is a folder here (``models/my-model`` with ``models/`` present)."""
    return path.startswith(("/", ".", "~")) or Path(path.split("/", 1)[0]).expanduser().is_dir()


# A model folder's tokenizer: one of these files (fast tokenizer, SentencePiece, BPE or WordPiece vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _model_folder(path: str, local: Path) -> list[str]:
    """The folder's config parses, its safetensors files are whole, and with weights comes a tokenizer."""
    from ppo_driver.model_files import safetensors_problem

    field = f"model.path={path!r}"
    config_json = local / "config.json"
    if not config_json.is_file():
        return [
            f"{field} is a folder without config.json; point it at a Hugging Face model folder "
            "(config.json, weights and tokenizer files)"
        ]
    try:
        parsed = json.loads(config_json.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return [f"{field}: {config_json} is not valid JSON ({exc}); copy it again from the model's source"]
    if not isinstance(parsed, dict):
        return [f"{field}: {config_json} holds a {type(parsed).__name__}, not a JSON object; copy it again"]
    problems = []
    weights = sorted(local.glob("*.safetensors"))
    for file in weights:
        problem = safetensors_problem(file)
        if problem is not None:
            problems.append(
                f"{field}: {problem}; copy or download it again, or re-run `ppo-driver import-model`"
            )
    index = local / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (ValueError, AttributeError):
            shards = set()
            problems.append(f"{field}: {index} is not a valid safetensors index; copy it again")
        missing = sorted(s for s in shards if not (local / s).is_file())
        if missing:
            problems.append(
                f"{field}: the weights index names {len(missing)} missing file(s) "
                f"({', '.join(missing[:3])}); copy the whole model folder"
            )
    has_weights = bool(weights) or any(local.glob("*.bin"))
    if has_weights and not any((local / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"{field}: the folder has no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the tokenizer files "
            "from the model's source, or make the folder with `ppo-driver import-model`"
        )
    return problems


def _backend(config: RunConfig) -> list[str]:
    p = config.placement
    role_gpus = {"placement.actor_gpus": p.actor_gpus}
    if p.critic == "dedicated" and p.critic_gpus is not None:
        role_gpus["placement.critic_gpus"] = p.critic_gpus
    problems = config.train.backend_problems(p.device, role_gpus)
    model_json = Path(config.model.path).expanduser() / "config.json" if config.model.path else None
    if model_json is not None and model_json.is_file():
        try:
            model_config = json.loads(model_json.read_text())
        except ValueError:
            model_config = {}
        problems += config.train.megatron_heads_problems(model_config)
        problems += _vllm_cpu_heads(config, model_config)
    return problems


def _vllm_cpu_heads(config: RunConfig, model_config: Any) -> list[str]:
    """``rollout.engine='vllm'`` on CPU: a head size vLLM's CPU attention runs (the tiny model's is a
    config rule)."""
    on_cpu = config.rollout.engine == "vllm" and config.placement.device == "cpu"
    if not on_cpu or not isinstance(model_config, dict):
        return []
    from ppo_rollout.engine.vllm_server import cpu_head_size_problem

    problem = cpu_head_size_problem(model_config, f"model.path={config.model.path!r}")
    return [] if problem is None else [problem]


def _in_hub_cache(repo_id: str) -> bool:
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    cache = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    snapshots = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def _dataset(config: RunConfig) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the training and evaluation files, read as the run reads them."""
    r = config.rollout
    if r.dataset is None:
        return [], []
    from ppo_rollout.data import JsonlPrompts

    files: dict[str, JsonlPrompts] = {}
    problems = []
    for field, dataset in (("rollout.dataset", r.dataset), ("rollout.eval_dataset", r.eval_dataset)):
        if dataset is None:
            continue
        path = Path(dataset).expanduser()
        if not path.is_file():
            problems.append(
                f"{field}={dataset!r} does not exist (or is not a file: {path.absolute()}); give the path "
                "of a JSONL file"
            )
            continue
        try:  # the whole file, as the run reads it: a bad line anywhere is found now
            files[field] = JsonlPrompts(path, r.prompt_field, config.train.seed, messages_ok=r.chat_template)
        except ValueError as exc:
            problems.append(f"{field}={dataset!r}: {exc}")
    train, held_out = files.get("rollout.dataset"), files.get("rollout.eval_dataset")
    if train is None or held_out is None:
        return problems, []
    return problems, _shared_prompts(train, held_out, r.prompt_field, r.eval_prompts)


def _shared_prompts(train: Any, held_out: Any, field: str, eval_prompts: int) -> list[str]:
    """A warning when prompts of the evaluation file (the rows an evaluation uses) are in the
    training file: the evaluation would then measure prompts the run trains on."""

    def key(row: dict[str, Any]) -> str:
        return json.dumps(row.get(field), sort_keys=True)

    trained = {key(row) for row in train.rows}
    used = held_out.rows[:eval_prompts]
    shared = sum(key(row) in trained for row in used)
    if not shared:
        return []
    return [
        f"rollout.eval_dataset: {shared} of the {len(used)} evaluation prompts are also in rollout.dataset "
        f"({train.path}), so the evaluation is not held out; remove them from one of the two files"
    ]


def check_dataset(config: RunConfig) -> str | None:
    """Tokenize every prompt of ``rollout.dataset`` as the run will (after ``check`` passed); raise
    ``ConfigError`` naming the line of the first prompt the run would fail on. Returns what was
    checked, e.g. "1000000 prompts, the longest 212 tokens, checked in 41.2 s"; None without a dataset."""
    if config.rollout.dataset is None or config.model.path is None:
        return None
    from ppo_driver import build
    from ppo_rollout.prompts import check_dataset as check_prompts

    model = Path(config.model.path).expanduser()
    tokenizer = _tokenizer_loads(config.model.path, model)
    try:
        rollout = build.rollout_config(config, model.resolve() if model.exists() else model)
        report = check_prompts(rollout, tokenizer)
    except ValueError as exc:
        raise ConfigError(
            f"invalid config (1 error):\n  - rollout.dataset={config.rollout.dataset!r}: {exc}"
        ) from None
    except OSError as exc:  # the tokenizer or model config of model.path does not load
        raise ConfigError(
            f"invalid config (1 error):\n  - model.path={config.model.path!r}: its tokenizer or config does "
            f"not load ({exc}); the dataset's prompts cannot be checked"
        ) from None
    return (
        f"{report.rows} prompts, the longest {report.longest_prompt} tokens, "
        f"checked in {report.seconds:.1f} s"
    )


def _tokenizer_loads(field: str, model: Path) -> Any:
    """The tokenizer of ``model.path``, loaded; else one line under ``model.path`` (transformers' own
    message runs to several lines, and the dataset's check would be blamed)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # OSError, ValueError, or what a tokenizer's own code raises
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(
            f"invalid config (1 error):\n  - model.path={field!r}: its tokenizer does not load ({first}); "
            "copy the tokenizer files from the model's source, or make the folder with "
            "`ppo-driver import-model`"
        ) from None


class DatasetCheck:
    """``check_dataset`` in a thread of its own, started at construction: ``train`` starts it once the
    driver's imports are done and takes its answer after the roles started, so reading the tokenizer and
    rendering and tokenizing every prompt (seconds for thousands of chat rows) run while Ray and the
    roles start instead of before them; a check that failed by the time Ray is up stops the run before
    the roles start. :meth:`result` waits for it and raises its ``ConfigError``."""

    def __init__(self, config: RunConfig) -> None:
        self._future: Future[str | None] = Future()
        # A daemon thread: a run that stops before it asks for the result does not wait for the check.
        threading.Thread(target=self._run, args=(config,), name="dataset-check", daemon=True).start()

    def _run(self, config: RunConfig) -> None:
        try:
            self._future.set_result(check_dataset(config))
        except BaseException as exc:  # handed to the caller of result()
            self._future.set_exception(exc)

    def result(self, timeout_s: float | None = None) -> str | None:
        """What ``check_dataset`` returned, once it finished; its error raised here."""
        return self._future.result(timeout_s)

    def raise_if_failed(self) -> None:
        """Raise the check's error if it has failed already; else return at once (it may still run)."""
        if self._future.done() and self._future.exception() is not None:
            self._future.result()


def _writable(field: str, folder: Path) -> list[str]:
    """The folder, or its nearest existing parent, is a writable folder (nothing is created here)."""
    folder = folder.expanduser().absolute()
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return [f"{field}: {probe} is a file, so the folder {folder} cannot be created; pick another path"]
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == folder else f"cannot be created: {probe} is not writable"
        return [f"{field}: {folder} {what}; pick a folder you can write to"]
    return []


def _checkpoint_parent(config: RunConfig, folder: Path) -> list[str]:
    """``checkpoint.resume=false`` moves an earlier run's checkpoints aside, a rename in the folder's
    parent: that parent must be writable when there are checkpoints to move."""
    from ppo_driver import checkpoint

    folder = folder.expanduser().absolute()
    if config.checkpoint.resume or not folder.is_dir():
        return []
    held = (c.name for c in folder.iterdir())  # what move_aside moves
    if not any(checkpoint.STEP_DIR.match(n) or n.startswith((".tmp-", ".old-")) for n in held):
        return []
    if os.access(folder.parent, os.W_OK | os.X_OK):
        return []
    return [
        f"checkpoint.dir: checkpoint.resume=false moves the earlier checkpoints in {folder} aside, but its "
        f"parent {folder.parent} is not writable; set checkpoint.resume=true, empty the folder, or pick "
        "another checkpoint.dir"
    ]


def visible_gpus() -> int:
    """The NVIDIA GPUs a local run's Ray instance will see: ``CUDA_VISIBLE_DEVICES`` when set, else
    the driver's list (``/proc/driver/nvidia/gpus``); read without CUDA, torch or Ray."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0


def check_devices(config: RunConfig) -> None:
    """A local run on cuda needs as many GPUs as its placement has bundles; else Ray waits for a
    placement group that never comes. (A joined cluster's GPUs are Ray's to count.)"""
    if config.placement.device != "cuda" or config.ray.address:
        return
    from ppo_driver import build
    from ppo_placement import plan_layout

    needed = plan_layout(build.placement_spec(config)).num_bundles
    have = visible_gpus()
    if have < needed:
        where = "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in os.environ else "this machine"
        raise ConfigError(
            f"invalid config (1 error):\n  - placement needs {needed} GPU{'s' if needed > 1 else ''} but "
            f"{where} shows {have}; set placement.device=cpu, use fewer GPUs (placement.actor_gpus, "
            "placement.rollout_gpus), or join a cluster that has them with --ray-address"
        )


def check_ray_address(config: RunConfig, timeout_s: float = 5.0) -> None:
    """``ray.address`` as ``HOST:PORT`` or ``ray://HOST:PORT``: something listens there and answers as a
    gRPC server does, as Ray's GCS and its client server do (Ray itself retries a closed port, or a port
    of another service, for minutes). ``auto`` is Ray's to resolve; with ``RAY_USE_TLS`` set only the
    port is checked."""
    import socket

    address = config.ray.address
    if not address or address == "auto":
        return
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        with socket.create_connection(
            (host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s
        ) as sock:
            if os.environ.get("RAY_USE_TLS", "0") not in ("0", "") or answers_http2(sock, timeout_s):
                return
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"invalid config (1 error):\n  - ray.address={address!r}: nothing answers at {host}:{port} "
            f"({reason}, within {timeout_s:g} s); start the cluster there (`ray start --head`), fix the "
            "address, or drop --ray-address for a local run"
        ) from None
    raise ConfigError(
        f"invalid config (1 error):\n  - ray.address={address!r}: something listens at {host}:{port} but "
        f"does not answer as Ray's GCS (a gRPC server) within {timeout_s:g} s; give the head node's GCS "
        "address (`ray status` on it prints it), or drop --ray-address for a local run"
    )
