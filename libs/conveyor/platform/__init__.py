"""The platform every service stands on, with no knowledge of training: the bus (Kafka),
the codec and message schemas, object storage, settings, telemetry and the service base."""
