"""access_requests of kind budget: the spent limits, the budget before and after, who decided

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("access_requests") as batch:
        batch.add_column(sa.Column("budget_spent", sa.Text))
        batch.add_column(sa.Column("budget_was", sa.Text))
        batch.add_column(sa.Column("budget_set", sa.Text))
        batch.add_column(sa.Column("decided_by", sa.String(80)))


def downgrade() -> None:
    with op.batch_alter_table("access_requests") as batch:
        batch.drop_column("decided_by")
        batch.drop_column("budget_set")
        batch.drop_column("budget_was")
        batch.drop_column("budget_spent")
