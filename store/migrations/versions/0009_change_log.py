"""change_log: what each change touched, so that a proxy applies a change without a full reload

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "change_log",
        sa.Column("counter", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("row_id", sa.Integer, primary_key=True),
    )


def downgrade() -> None:
    op.drop_table("change_log")
