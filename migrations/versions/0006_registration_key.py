"""registration key: nodes remember the SHA-256 of the key their agent registered with (idempotent retry)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 13:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('registration_key_hash', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('registration_key_hash')
