from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from ppo_rollout.config import RolloutConfig, SamplingConfig, SGLangOptions
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.rollout_fns import PromptGroup
from ppo_rollout.tasks import get_task, make_tiny_model
from ppo_testsupport import skip_gpu_tests_without_cuda

torch.set_num_threads(1)


pytest_collection_modifyitems = skip_gpu_tests_without_cuda("needs CUDA")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("copy", tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def standin_config(tiny_model: Path) -> Callable[..., RolloutConfig]:
    """``make(record, **settings)``: a rollout config whose one SGLang engine is the stand-in (launched
    through the adapter's code path), every request it answers appended to ``record``."""

    def make(record: Path, **settings: Any) -> RolloutConfig:
        standin = SGLangOptions(
            command=(sys.executable, "-m", "ppo_rollout.testing.sglang_standin"),
            extra_args=("--standin-record", str(record)),
            startup_timeout_s=240,
        )
        base = {"engine": "sglang", "gpus_per_engine": 1, "task": "copy", "prompts_per_step": 2}
        return RolloutConfig(model_path=str(tiny_model), **{**base, "sglang": standin, **settings})

    return make


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    ray.init(
        num_cpus=4,
        num_gpus=0,
        object_store_memory=256 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@dataclass(frozen=True)
class Slots:
    """What ppo_placement.RoleSlots carries, built here from a real placement group."""

    placement_group: Any
    bundle_indices: tuple[int, ...]
    gpu_ids: tuple[int, ...] = ()
    gpu_share: float = 0.0


@pytest.fixture(scope="session")
def slots(ray_session: None) -> Iterator[Slots]:
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    # Reversed on purpose: engine i must land on bundle_indices[i], not on bundle i.
    yield Slots(pg, (1, 0))
    remove_placement_group(pg)


@pytest.fixture(scope="session")
def manager(slots: Slots, tiny_model: Path) -> Iterator[object]:
    """Two built-in engines on a placement group's bundles, the copy task, dp_size 2."""
    from ppo_rollout.config import RolloutConfig, SamplingSettings
    from ppo_rollout.manager import RolloutManager

    config = RolloutConfig(
        model_path=str(tiny_model),
        task="copy",
        num_engines=2,
        prompts_per_step=4,
        sampling=SamplingSettings(temperature=1.0, max_new_tokens=6, n_samples_per_prompt=3),
        eval_prompts=4,
        seed=3,
        timeout_s=120.0,
    )
    mgr = RolloutManager(config, slots, dp_size=2)
    yield mgr
    mgr.shutdown()


# The multi-turn tests' engines: a guess_digit tiny model's generation core behind submit_generate.
class LocalEngine:
    """A generation core behind ``submit_generate``, each call on its own thread, every call recorded.

    Real engines are processes of their own. Two cores computing at once in one process give log-probs
    that differ in their last bit from run to run (seen with one torch thread, in the same waves), so
    the cores of one process take turns (``COMPUTE``): a call's numbers depend on its inputs alone, as in
    separate processes, while the client still sees every engine busy until its call returns."""

    COMPUTE = threading.Lock()

    def __init__(self, core: GenerationCore) -> None:
        self.core = core
        self.calls: list[tuple[list[list[int]], SamplingConfig, int]] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int) -> Any:
        with LocalEngine.COMPUTE:
            return self.core.generate(prompts, sampling, seed)

    def submit_generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int) -> Any:
        self.calls.append(([list(p) for p in prompts], sampling, seed))
        future = self.pool.submit(self._generate, prompts, sampling, seed)
        return lambda timeout_s: future.result(timeout_s)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("guess_digit", tmp_path_factory.mktemp("guess") / "model", seed=3)


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture
def engines(tiny: Path) -> Iterator[list[LocalEngine]]:
    out = [LocalEngine(GenerationCore(tiny)) for _ in range(2)]
    yield out
    for e in out:
        e.pool.shutdown()


def guess_groups(tokenizer: Any, count: int, samples: int) -> list[PromptGroup]:
    task = get_task("guess_digit")
    rows = [task.row(i, 7) for i in range(count)]
    return [
        PromptGroup(i, row, row["prompt"], tuple(tokenizer(row["prompt"])["input_ids"]), samples)
        for i, row in enumerate(rows)
    ]
