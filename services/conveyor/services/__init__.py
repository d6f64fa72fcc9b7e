"""One package per service; each has config.py, service.py and its domain modules."""
