"""token lifecycle: optional expiry on API tokens, node tokens found by node

Revision ID: 0004
Revises: 0001
Create Date: 2026-11-23 05:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index('ix_api_tokens_node_name', ['node_name'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_index('ix_api_tokens_node_name')
        batch_op.drop_column('expires_at')
