"""credentials.options and a wider credentials.scheme, for schemes with settings of their own
(signed and minted credentials); grants.encoded_slash, for a `*` that may match a segment
holding %2F

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _widen_scheme(length: int, before: int) -> None:
    # SQLite ignores VARCHAR lengths, and its batch mode would copy the table that grants
    # reference; only the other backends need the ALTER.
    if op.get_bind().dialect.name != "sqlite":
        op.alter_column(
            "credentials",
            "scheme",
            existing_type=sa.String(before),
            type_=sa.String(length),
            existing_nullable=False,
        )


def upgrade() -> None:
    _widen_scheme(32, 16)
    with op.batch_alter_table("credentials") as batch:
        batch.add_column(sa.Column("options", sa.JSON, nullable=True))
    with op.batch_alter_table("grants") as batch:
        batch.add_column(
            sa.Column("encoded_slash", sa.Boolean, nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("grants") as batch:
        batch.drop_column("encoded_slash")
    # Not batch mode: SQLite's copy of credentials would be refused while grants point at it.
    op.drop_column("credentials", "options")
    _widen_scheme(16, 32)
