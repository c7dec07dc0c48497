"""grants.body: what a grant lets the request's body ask (GraphQL, MCP, JSON-RPC);
access_requests.operation: what a held request's body asked

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("grants") as batch:
        batch.add_column(sa.Column("body", sa.Text, nullable=True))
    # What a held request's body asked (e.g. "mutation addComment"): shown to the owner, and
    # part of the kind a `first` approval covers.
    with op.batch_alter_table("access_requests") as batch:
        batch.add_column(sa.Column("operation", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("access_requests") as batch:
        batch.drop_column("operation")
    with op.batch_alter_table("grants") as batch:
        batch.drop_column("body")
