"""Reservoir: reinforcement fine-tuning around a PostgreSQL experience store."""

__version__ = "0.1.0"
