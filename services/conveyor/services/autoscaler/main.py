"""Entry point of the autoscaler outside the embedded stack: read the settings, build the
``docker`` or ``kubernetes`` driver, run the service. (``conveyor service autoscaler`` runs
:mod:`conveyor.embedded.supervisor`, which adds the ``local`` driver and calls :func:`run`.)"""

from __future__ import annotations

from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.platform.service import run_service
from conveyor.services.autoscaler.config import AutoscalerSettings
from conveyor.services.autoscaler.drivers import POOL, TRAINERS, ScaleDriver
from conveyor.services.autoscaler.service import AutoscalerService


def remote_driver(settings: AutoscalerSettings, pool: str = POOL) -> ScaleDriver:
    """The ``docker`` or ``kubernetes`` driver the settings name, for ``pool`` (the compose
    service, or the Deployment the settings name for it); ValueError for ``local`` (it needs
    the embedded stack) and DriverError when Kubernetes has no configuration."""
    # The drivers' clients are imported where they are used: the kubernetes client alone takes
    # about two seconds of CPU to import, which the embedded stack's autoscaler never needs.
    from conveyor.services.autoscaler.drivers.docker import DockerDriver, engine_client
    from conveyor.services.autoscaler.drivers.kubernetes import KubernetesDriver, api_client

    if settings.driver == "docker":
        assert settings.docker_project is not None  # the settings check it
        return DockerDriver(client=engine_client(settings.docker_url),
                            project=settings.docker_project, service=pool)  # fmt: skip
    if settings.driver == "kubernetes":
        deployment = (settings.kubernetes_trainer_deployment if pool == TRAINERS
                      else settings.kubernetes_deployment)  # fmt: skip
        return KubernetesDriver(api=api_client(settings.kubernetes_api_url),
                                namespace=settings.kubernetes_namespace,
                                deployment=deployment)  # fmt: skip
    raise ValueError("the local driver runs inside the embedded stack (conveyor up)")


def run(
    settings: AutoscalerSettings, driver: ScaleDriver, trainer_driver: ScaleDriver | None = None
) -> int:
    """Run the service with ``driver`` (and ``trainer_driver`` when the settings scale the
    trainer pool) until SIGTERM/SIGINT; returns the exit code."""
    service = AutoscalerService(settings=settings, driver=driver, kafka=KafkaSettings(),
                                telemetry=TelemetrySettings(),
                                trainer_driver=trainer_driver)  # fmt: skip
    return run_service(service)
