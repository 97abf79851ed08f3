"""Alembic environment and versions of the experience store's schema (installed as reservoir.migrations)."""
