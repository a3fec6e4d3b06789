"""desired generation: one counter row, bumped by every commit that changes the fleet's desired state

Replicas cache desired state per generation and wake long-polling agents when it moves (controller.watch).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'desired_generation',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('value', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_desired_generation')),
    )
    op.execute("INSERT INTO desired_generation (id, value) VALUES (1, 1)")


def downgrade() -> None:
    op.drop_table('desired_generation')
