"""grants.key: the stable id a policy file gives a grant, unique among unrevoked grants

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("grants") as batch:
        batch.add_column(sa.Column("key", sa.String(63), nullable=True))
    op.create_index(
        "uq_grants_live_key",
        "grants",
        ["key"],
        unique=True,
        sqlite_where=sa.text("revoked_at IS NULL AND key IS NOT NULL"),
        postgresql_where=sa.text("revoked_at IS NULL AND key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("uq_grants_live_key", table_name="grants")
    with op.batch_alter_table("grants") as batch:
        batch.drop_column("key")
