"""No ``asyncio.wait_for`` in the product: on Python 3.11 it drops a cancel that meets the
completion of what it awaits (it returns the result instead), so a loop that waits with it can
ignore a stop forever. ``asyncio.timeout`` counts cancels and does not; 3.12 rebuilt
``wait_for`` on it. The services run on 3.11, so the product waits with ``asyncio.timeout``.
The behaviour itself is tested on the job host (test_jobhost); this keeps the pattern out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [ROOT / "libs", ROOT / "services", ROOT / "loadtests", ROOT / "examples"]


def wait_for_calls(path: Path) -> list[int]:
    """Lines of ``asyncio.wait_for(...)`` calls in ``path``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "wait_for"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "asyncio"
    ]


def test_the_check_finds_a_wait_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import asyncio\n\n\nasync def f(e):\n    await asyncio.wait_for(e, 1)\n")
    assert wait_for_calls(sample) == [5]


def test_the_product_waits_with_asyncio_timeout_not_wait_for() -> None:
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for folder in PRODUCT
        for path in folder.rglob("*.py")
        for line in wait_for_calls(path)
    }
    assert not found, f"asyncio.wait_for drops cancels on 3.11; use asyncio.timeout: {found}"
