"""access_requests: what agents asked for, and what the owner decided

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from store.db.models import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "access_requests",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("principal_id", sa.Integer, sa.ForeignKey("principals.id"), nullable=False),
        sa.Column("host", sa.String(253), nullable=False),
        sa.Column("port", sa.Integer, nullable=False),
        sa.Column("method", sa.String(32), nullable=False),
        sa.Column("path", sa.String(2048), nullable=False),
        sa.Column("purpose", sa.Text),
        sa.Column("source", sa.String(8), nullable=False),
        sa.Column("state", sa.String(8), nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("first_seen", UTCDateTime, nullable=False),
        sa.Column("last_seen", UTCDateTime, nullable=False),
        sa.Column("decided_at", UTCDateTime),
        sa.Column("decision_reason", sa.Text),
        sa.Column("grant_id", sa.Integer, sa.ForeignKey("grants.id")),
    )
    op.create_index(
        "ix_access_requests_principal_state", "access_requests", ["principal_id", "state"]
    )


def downgrade() -> None:
    op.drop_table("access_requests")
