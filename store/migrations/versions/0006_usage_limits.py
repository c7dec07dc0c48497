"""Usage limits: a rate and burst per grant and per principal, and grants with a use count

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("grants") as batch:
        batch.add_column(sa.Column("rate", sa.String(16), nullable=True))
        batch.add_column(sa.Column("burst", sa.Integer, nullable=True))
        batch.add_column(sa.Column("max_uses", sa.Integer, nullable=True))
        batch.add_column(sa.Column("uses", sa.Integer, nullable=False, server_default="0"))
    with op.batch_alter_table("principals") as batch:
        batch.add_column(sa.Column("rate", sa.String(16), nullable=True))
        batch.add_column(sa.Column("burst", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("grants") as batch:
        for name in ("uses", "max_uses", "burst", "rate"):
            batch.drop_column(name)
    # Not batch mode: SQLite's copy of principals would be refused while grants point at it.
    op.drop_column("principals", "burst")
    op.drop_column("principals", "rate")
