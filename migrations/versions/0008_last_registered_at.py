"""node start-up grace

Nodes remember when their agent last registered (``last_registered_at``): a node that has not heartbeated since
is judged stale only after ``node_startup_grace_seconds`` (its registration reply may have been lost and its
retries queued behind a cold start of the fleet), as Kubernetes' node lifecycle controller gives a starting
node ``--node-startup-grace-period`` (``controller.tick.mark_stale``). Existing rows: NULL (no grace).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 19:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('last_registered_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('last_registered_at')
