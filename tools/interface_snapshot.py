"""Each package's public interface, recorded per release: ``python tools/interface_snapshot.py --check``.

A package's public interface is the names its public modules export (``__all__``, else the classes,
functions and upper-case constants a module defines) with their signatures: a class's constructor
and its public methods and properties, a function's parameters and return annotation, a constant's
value. ``tools/interfaces/<distribution>.json`` records it with the version it was released as.

``--check`` (``nox -s release-check``) fails when a package's interface differs from the record while
its version in ``packages/<folder>/pyproject.toml`` is still the recorded one (a change shipped without
a version bump), when a version has no section in the package's CHANGELOG.md, or when a package's
requirement on a sibling excludes that sibling's version. ``--update`` records the current interfaces
and versions (run it after bumping a version).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "tools" / "interfaces"

# distribution -> (folder under packages/, its public modules)
PUBLIC: dict[str, tuple[str, tuple[str, ...]]] = {
    "ppo-placement": ("placement", ("ppo_placement",)),
    "ppo-lifecycle": (
        "lifecycle",
        (
            "ppo_lifecycle.plan",
            "ppo_lifecycle.stats",
            "ppo_lifecycle.lifecycle",
            "ppo_lifecycle.memory",
            "ppo_lifecycle.process_groups",
        ),
    ),
    "ppo-weight-sync": ("weight_sync", ("ppo_weight_sync",)),
    "ppo-value-transport": ("value_transport", ("ppo_value_transport",)),
    "ppo-trainer": (
        "trainer",
        (
            "ppo_trainer",
            "ppo_trainer.config",
            "ppo_trainer.group",
            "ppo_trainer.worker",
            "ppo_trainer.backend",
            "ppo_trainer.objective",
        ),
    ),
    "ppo-rollout": (
        "rollout",
        (
            "ppo_rollout.config",
            "ppo_rollout.tasks",
            "ppo_rollout.rewards",
            "ppo_rollout.manager",
            "ppo_rollout.slots",
            "ppo_rollout.engine.builtin",
            "ppo_rollout.engine.core",
            "ppo_rollout.engine.sglang",
        ),
    ),
    "ppo-driver": (
        "ppo_driver",
        (
            "ppo_driver.config",
            "ppo_driver.build",
            "ppo_driver.loop",
            "ppo_driver.roles",
            "ppo_driver.phases",
            "ppo_driver.checkpoint",
            "ppo_driver.metrics",
            "ppo_driver.plot",
        ),
    ),
    "ppo-testsupport": ("testsupport", ("ppo_testsupport",)),
}

ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
CONSTANT = (str, int, float, bool, tuple, frozenset)


def _portable(text: str) -> str:
    """``text`` without what differs between machines: object addresses, this interpreter's path (a
    default such as SGLang's launch command holds it)."""
    return ADDRESS.sub("", text).replace(repr(sys.executable), "'<python>'")


def _signature(obj: Any) -> str:
    try:
        return _portable(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def _describe_class(cls: type) -> dict[str, str]:
    members = {"": f"class{_signature(cls)}"}
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            members[name] = "property"
        elif isinstance(member, staticmethod | classmethod):
            members[name] = f"{type(member).__name__}{_signature(member.__func__)}"
        elif inspect.isfunction(member):
            members[name] = f"def{_signature(member)}"
    return members


def _describe(obj: Any) -> Any:
    if inspect.isclass(obj):
        return _describe_class(obj)
    if callable(obj):
        return f"def{_signature(obj)}"
    if isinstance(obj, frozenset):  # its repr's order follows the string hash seed
        return f"frozenset({sorted(map(repr, obj))})"
    if isinstance(obj, CONSTANT):
        return _portable(repr(obj))
    return type(obj).__name__


def _public_names(module: ModuleType) -> list[str]:
    exported = module.__dict__.get("__all__")
    if exported is not None:
        return sorted(exported)
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_"):
            continue
        defined_here = getattr(obj, "__module__", None) == module.__name__
        code = (inspect.isclass(obj) or inspect.isfunction(obj)) and defined_here
        if code or (name.isupper() and isinstance(obj, CONSTANT)):
            names.append(name)
    return sorted(names)


def interface(dist: str) -> dict[str, Any]:
    """``dist``'s public interface: module -> name -> description."""
    found: dict[str, Any] = {}
    for module_name in PUBLIC[dist][1]:
        module = importlib.import_module(module_name)
        found[module_name] = {name: _describe(getattr(module, name)) for name in _public_names(module)}
    return found


def _project(dist: str, repo: Path = REPO) -> dict[str, Any]:
    path = repo / "packages" / PUBLIC[dist][0] / "pyproject.toml"
    project: dict[str, Any] = tomllib.loads(path.read_text())["project"]
    return project


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix and key else (prefix or key)
        if isinstance(value, dict):
            out.update(_flat(value, name))
        else:
            out[name] = value
    return out


def _changes(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    old, new = _flat(recorded), _flat(current)
    lines = [f"  removed {name}" for name in sorted(old.keys() - new.keys())]
    lines += [f"  added {name}" for name in sorted(new.keys() - old.keys())]
    lines += [
        f"  changed {name}: {old[name]} -> {new[name]}"
        for name in sorted(old.keys() & new.keys())
        if old[name] != new[name]
    ]
    return "\n".join(lines[:20] + ([f"  ... and {len(lines) - 20} more"] if len(lines) > 20 else []))


def problems(repo: Path = REPO, dists: tuple[str, ...] = tuple(PUBLIC)) -> list[str]:
    """Everything that stops a release of ``dists``, one message per problem."""
    found: list[str] = []
    versions = {dist: Version(_project(dist, repo)["version"]) for dist in PUBLIC}
    for dist in dists:
        folder = PUBLIC[dist][0]
        version = versions[dist]
        changelog = repo / "packages" / folder / "CHANGELOG.md"
        if not re.search(rf"^## {re.escape(str(version))}\b", changelog.read_text(), re.M):
            found.append(f"{dist} {version}: packages/{folder}/CHANGELOG.md has no '## {version}' section")
        for requirement in map(Requirement, _project(dist, repo)["dependencies"]):
            if requirement.name in versions and versions[requirement.name] not in requirement.specifier:
                found.append(
                    f"{dist} requires {requirement}, which excludes {requirement.name} "
                    f"{versions[requirement.name]}: widen the range in packages/{folder}/pyproject.toml"
                )
        record_path = repo / "tools" / "interfaces" / f"{dist}.json"
        if not record_path.exists():
            found.append(f"{dist}: no recorded interface; run `python tools/interface_snapshot.py --update`")
            continue
        record = json.loads(record_path.read_text())
        current = interface(dist)
        if current != record["interface"] and str(version) == record["version"]:
            found.append(
                f"{dist}: the public interface changed since {record['version']} without a version bump; "
                f"raise version in packages/{folder}/pyproject.toml, add its CHANGELOG section, then run "
                f"`python tools/interface_snapshot.py --update`:\n{_changes(record['interface'], current)}"
            )
    return found


def update() -> None:
    RECORDS.mkdir(parents=True, exist_ok=True)
    for dist in PUBLIC:
        record = {"version": _project(dist)["version"], "interface": interface(dist)}
        (RECORDS / f"{dist}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"recorded {dist} {record['version']}")


def main(argv: list[str]) -> int:
    if argv == ["--update"]:
        update()
        return 0
    if argv == ["--check"]:
        found = problems()
        for problem in found:
            print(problem, file=sys.stderr)
        return 1 if found else 0
    print("usage: python tools/interface_snapshot.py --check | --update", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
