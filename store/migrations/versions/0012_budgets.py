"""Token budgets: grants.budget, and budget_usage, the tokens charged per grant and window

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("grants") as batch:
        batch.add_column(sa.Column("budget", sa.Text, nullable=True))
    op.create_table(
        "budget_usage",
        sa.Column("grant_id", sa.Integer, primary_key=True),
        sa.Column("window", sa.String(24), primary_key=True),
        sa.Column("input_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("output_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("requests", sa.Integer, nullable=False, server_default="0"),
        sa.Column("estimated", sa.Integer, nullable=False, server_default="0"),
        sa.Column("spend_micros", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("budget_usage")
    with op.batch_alter_table("grants") as batch:
        batch.drop_column("budget")
