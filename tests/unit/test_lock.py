"""The lock files pin what pyproject.toml asks for: requirements.lock what the service image
installs (the base dependencies, none of the extras), requirements-dev.lock what `make test`
installs. A dependency added to pyproject.toml without `make lock` fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
UNPINNED = {"torch", "conveyor"}
"""Left out of the locks: torch is pinned exactly in pyproject.toml and its build (CPU or
CUDA) depends on the machine; conveyor is the project itself."""


def pins(path: Path) -> dict[str, Version]:
    """``name==version`` lines of a pip-compile output, by canonical name."""
    found: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        if not line or line[0] in "# ":
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        assert match, f"{path.name}: not an exact pin: {line!r}"
        found[canonicalize_name(match[1])] = Version(match[2])
    return found


def requirements(*extras: str) -> list[Requirement]:
    """The project's requirements with ``extras``, the self-references expanded."""
    wanted = [Requirement(r) for r in PROJECT["dependencies"]]
    pending = list(extras)
    while pending:
        for text in PROJECT["optional-dependencies"][pending.pop()]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == "conveyor":
                pending.extend(requirement.extras)
            else:
                wanted.append(requirement)
    return [r for r in wanted if r.marker is None or r.marker.evaluate()]


def assert_pinned(lock: Path, wanted: list[Requirement]) -> dict[str, Version]:
    pinned = pins(lock)
    assert not UNPINNED & set(pinned), f"{lock.name} pins {UNPINNED & set(pinned)}"
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        if name in UNPINNED:
            continue
        assert name in pinned, f"{lock.name} lacks {requirement} (run `make lock`)"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{lock.name} pins {name}=={pinned[name]}, pyproject.toml asks {requirement}"
        )
    header = lock.read_text().splitlines()[:6]
    assert "#    make lock" in header, f"{lock.name} was not written by `make lock`"
    return pinned


def test_the_image_lock_pins_the_base_dependencies_and_no_extra() -> None:
    pinned = assert_pinned(ROOT / "requirements.lock", requirements())
    for extra in ("embedded", "digits"):
        for text in PROJECT["optional-dependencies"][extra]:
            name = canonicalize_name(Requirement(text).name)
            assert name not in pinned, f"the service image would carry {name} ({extra})"


def test_the_dev_lock_pins_everything_make_test_installs() -> None:
    dev = assert_pinned(ROOT / "requirements-dev.lock", requirements("dev"))
    image = pins(ROOT / "requirements.lock")
    # One version of each package across both locks: the image runs what the tests ran.
    assert {name: dev[name] for name in image} == image


def test_make_installs_the_extras_the_image_leaves_out() -> None:
    dev = [Requirement(text) for text in PROJECT["optional-dependencies"]["dev"]]
    (itself,) = [r for r in dev if canonicalize_name(r.name) == "conveyor"]
    assert itself.extras == {"embedded", "digits"}
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet --no-compile -c requirements-dev.lock -e '.[dev]'" in makefile
