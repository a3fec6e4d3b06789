"""serve phase: trial before serve (assignments.phase/phase_at, activations.rollout_id/verified_at)

A canary's candidate is staged, verified (pre-serve trial accepted) then serving. Canaries in flight when
this runs keep their behaviour: a candidate the node already reports active is "serving", any other
candidate "staged" (it serves once its next hard-gates-passed report is accepted).

Revision ID: 0003
Revises: 0001
Create Date: 2026-11-23 05:01:34.431071
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('activations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rollout_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True))
        batch_op.add_column(sa.Column('verified_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_activations_rollout_id_rollouts'), 'rollouts', ['rollout_id'], ['id'])

    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('phase', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('phase_at', sa.DateTime(timezone=True), nullable=True))

    op.execute("UPDATE assignments SET phase = 'serving', phase_at = updated_at "
               "WHERE rollout_id IS NOT NULL AND active_bundle_id = desired_bundle_id")
    op.execute("UPDATE assignments SET phase = 'staged', phase_at = updated_at "
               "WHERE rollout_id IS NOT NULL AND phase IS NULL")


def downgrade() -> None:
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.drop_column('phase_at')
        batch_op.drop_column('phase')

    with op.batch_alter_table('activations', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_activations_rollout_id_rollouts'), type_='foreignkey')
        batch_op.drop_column('verified_at')
        batch_op.drop_column('rollout_id')

