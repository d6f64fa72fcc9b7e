"""``/jobs`` and ``/jobs/{job_id}``: the job pages people look at (HTML, no script), rendered
from the same view as the API's JSON by :mod:`conveyor.training.jobreport`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from conveyor.services.gateway.routes.deps import BackendDep
from conveyor.services.gateway.schemas import Job, JobStages, ListLimit
from conveyor.training.jobreport import ReportLinks, job_page, jobs_page

router = APIRouter(prefix="/jobs", tags=["pages"], include_in_schema=False)


@router.get("", response_class=HTMLResponse)
async def jobs_list_page(backend: BackendDep, limit: ListLimit = 100) -> HTMLResponse:
    """Jobs, newest first, each linking to its page."""
    schedule = backend.schedule()
    jobs = [
        Job.of(job, schedule).model_dump(mode="json")
        for job in backend.list_jobs(state=None, limit=limit)
    ]
    html = jobs_page(jobs, job_href="/jobs/{id}", refresh_s=backend.settings.page_refresh_s)
    return HTMLResponse(html)


@router.get("/{job_id}", response_class=HTMLResponse)
async def job_detail_page(job_id: str, backend: BackendDep) -> HTMLResponse:
    """One job's page (404 as JSON for an unknown id, like the API)."""
    view = backend.get_job(job_id)
    settings = backend.settings
    links = ReportLinks(jaeger_url=settings.jaeger_url, grafana_url=settings.grafana_url)
    html = job_page(
        Job.of(view, backend.schedule()).model_dump(mode="json"),
        JobStages.of(view).model_dump(mode="json"),
        links=links,
        refresh_s=settings.page_refresh_s,
        jobs_href="/jobs",
    )
    return HTMLResponse(html)
