"""Model plug-ins through the real stack: a package registered under the ``conveyor.models``
entry-point group (on the services' PYTHONPATH, as an installed package would be) trains like a
built-in, and a job naming a model no process has fails with the reason before training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2e_stack import digits_spec, running_stack
from ledger_check import assert_exactly_once
from model_plugin import PLUGIN_MODEL, write_plugin

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_plugin_model_trains_and_an_unknown_one_fails_clearly(tmp_path: Path) -> None:
    plugin = write_plugin(tmp_path / "site")
    pythonpath = os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))
    with running_stack(tmp_path / "state", env={"PYTHONPATH": pythonpath}) as stack:
        job_id = stack.submit(
            digits_spec("plugin-model", epochs=2, model={"name": PLUGIN_MODEL, "hidden": 64})
        )
        missing_id = stack.submit(digits_spec("missing-model", model={"name": "nobody_has_it"}))
        job = stack.wait_job(job_id, timeout_s=120)
        missing = stack.wait_job(missing_id, timeout_s=60)
    assert job["state"] == "completed", job.get("reason")
    assert job["summary"]["eval_accuracy"] > 0.7  # chance is 0.1; a 64-unit MLP, 2 epochs
    assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=2)
    assert missing["state"] == "failed" and missing["plan"] is None
    assert "unknown model 'nobody_has_it'" in missing["reason"]
    assert PLUGIN_MODEL in missing["reason"]  # the known models, plug-ins included, are named
