"""console_tokens: the approvers' console operators' tokens, hashed, each with an expiry

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

from store.db.models import UTCDateTime

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("operator", sa.String(63), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.Column("revoked_at", UTCDateTime),
    )
    op.create_index("ix_console_tokens_operator", "console_tokens", ["operator"])


def downgrade() -> None:
    op.drop_table("console_tokens")
