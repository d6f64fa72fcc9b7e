"""The embedded single-machine stack: broker, object store and services as child processes."""
