"""Approvals: grants whose requests wait for an owner, and the held requests they record;
rate buckets shared by replicas (run --shared-rates)

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

from store.db.models import UTCDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("grants") as batch:
        batch.add_column(sa.Column("approval", sa.String(8), nullable=True))
        batch.add_column(sa.Column("hold", sa.Integer, nullable=True))
    with op.batch_alter_table("access_requests") as batch:
        batch.add_column(sa.Column("kind", sa.String(8), nullable=False, server_default="access"))
        batch.add_column(sa.Column("hold_until", UTCDateTime, nullable=True))
        batch.add_column(sa.Column("cover_until", UTCDateTime, nullable=True))
        batch.add_column(sa.Column("cover_uses", sa.Integer, nullable=True))
        batch.add_column(sa.Column("covered", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "rate_buckets",
        sa.Column("key", sa.String(160), primary_key=True),
        sa.Column("tokens", sa.Float, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("rate_buckets")
    with op.batch_alter_table("access_requests") as batch:
        for name in ("covered", "cover_uses", "cover_until", "hold_until", "kind"):
            batch.drop_column(name)
    with op.batch_alter_table("grants") as batch:
        batch.drop_column("hold")
        batch.drop_column("approval")
