"""Alembic environment and versions for the kernelctl changelog schema."""
