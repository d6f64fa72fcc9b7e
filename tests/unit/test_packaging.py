"""The distribution as users get it: a wheel built from the three source roots (libs/,
services/, cli/) installs one ``conveyor`` namespace that imports without the source tree."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("conveyor-*.whl")
    return built


def test_the_wheel_holds_one_namespace_from_the_three_source_roots(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "conveyor/__main__.py",
        "conveyor/platform/bus/consumer.py",
        "conveyor/training/jobspec/__init__.py",
        "conveyor/services/trainer/service.py",
        "conveyor/services/gateway/routes/jobs.py",
        "conveyor/cli/main.py",
        "conveyor/embedded/stack.py",
        "conveyor/platform/py.typed",
    ):
        assert expected in names, expected
    assert "conveyor/__init__.py" not in names  # a namespace package: portions must not clash
    assert not any(name.startswith(("libs/", "services/", "cli/", "tests/", "loadtests/"))
                   for name in names)  # fmt: skip


def test_the_installed_wheel_imports_every_part_without_the_source_tree(
    wheel: Path, tmp_path: Path
) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    # -S: no site processing, so the editable install's finder (a .pth hook) is not loaded;
    # the dependencies come from site-packages on the path after the unpacked wheel.
    path = f"{tmp_path}:{sysconfig.get_paths()['purelib']}"
    script = (
        "import conveyor.platform.bus, conveyor.training.plan, conveyor.services.trainer.service,"
        " conveyor.services.gateway.service, conveyor.cli.main, conveyor.embedded.stack\n"
        "print(conveyor.platform.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", script],
        env={"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "conveyor" / "platform" / "__init__.py")
    help_text = subprocess.run(
        [sys.executable, "-S", "-m", "conveyor", "--help"],
        env={"PYTHONPATH": path, "COLUMNS": "120"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert help_text.returncode == 0, help_text.stderr
    assert "service" in help_text.stdout
