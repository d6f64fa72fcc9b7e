"""The ``conveyor`` command line (``main``), its job commands and the gateway's HTTP client."""
