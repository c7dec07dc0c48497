"""principal_tokens: further tokens of a principal (sessions), each with an expiry and a revocation

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

from store.db.models import UTCDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "principal_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("principal_id", sa.Integer, sa.ForeignKey("principals.id"), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("note", sa.String(200)),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime),
        sa.Column("revoked_at", UTCDateTime),
    )
    op.create_index("ix_principal_tokens_principal_id", "principal_tokens", ["principal_id"])


def downgrade() -> None:
    op.drop_table("principal_tokens")
