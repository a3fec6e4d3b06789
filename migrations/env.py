"""Alembic environment: runs migrations on the engine handed over by controller.db.migrate."""

from __future__ import annotations

from alembic import context

from controller.db.engine import make_engine
from controller.db.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        from kernelctl.settings import get_settings

        engine = make_engine(config.get_main_option("sqlalchemy.url") or get_settings().database_url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


run_migrations_online()
