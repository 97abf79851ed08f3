"""Alembic revisions, oldest first; each one small, reversible and named for what it does."""
