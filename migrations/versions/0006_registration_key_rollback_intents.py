"""registration key and rollback intents

Nodes remember the SHA-256 of the key their agent registered with (a retry whose reply was lost gets the same
node); ``rollback_intents`` makes "a rollback wins over a promote" a fact every replica sees.

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
    op.create_table(
        'rollback_intents',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('rollout_id', sa.BigInteger(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_rollback_intents')),
    )
    op.create_index(op.f('ix_rollback_intents_rollout_id'), 'rollback_intents', ['rollout_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_rollback_intents_rollout_id'), table_name='rollback_intents')
    op.drop_table('rollback_intents')
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('registration_key_hash')
