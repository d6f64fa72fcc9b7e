"""Conveyor: distributed PyTorch training fed by a Kafka data pipeline."""

__version__ = "0.1.0"
