"""Reporting: what a trainer says about itself. ``figures`` is the one object holding its
numbers in a job (counters, time accounting, stage latencies) and producing the data of
progress events and the info of heartbeats; ``metrics`` holds its Prometheus collectors and
the GPU probe; ``reporter`` publishes progress events on the jobs topic and heartbeats on the
job's control topic."""
