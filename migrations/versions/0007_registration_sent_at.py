"""registration attempt order

Nodes remember when (on the agent's own clock) the registration attempt the controller last took was sent: an
attempt answered late, after a later attempt of the same agent, is refused instead of revoking the token that
later attempt issued (``controller.enrollment``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 11:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('registration_sent_ns', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('registration_sent_ns')
