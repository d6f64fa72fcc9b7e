"""The autoscaler's drivers: how a pool's replicas are counted and changed.

``docker`` and ``kubernetes`` live here; ``local``, the embedded stack's processes, lives with
the stack it supervises (``conveyor.embedded.supervisor``: it owns ``stack.json``, which the
services layer may not import), and the entry point picks one by the ``driver`` setting.
"""

from conveyor.services.autoscaler.drivers.base import DriverError, Restart, ScaleDriver

POOL = "preprocessor"
"""The pool the autoscaler sizes from the data-plane signals."""
TRAINERS = "trainer"
"""The pool it sizes from the queue of jobs, when configured to."""

__all__ = ["POOL", "TRAINERS", "DriverError", "Restart", "ScaleDriver"]
