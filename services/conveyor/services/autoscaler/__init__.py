"""The autoscaler: sizes the preprocessor pool from measured signals (and, with the local
driver, restarts dead services of the embedded stack)."""
