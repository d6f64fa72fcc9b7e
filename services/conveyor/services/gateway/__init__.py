"""The gateway: the job API over the event-sourced view of ``conveyor.jobs`` (DESIGN 5).

Run it with ``conveyor service gateway`` (entry: ``conveyor.services.gateway.main:main``).
"""
