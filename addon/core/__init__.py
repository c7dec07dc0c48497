"""Pure decisions, importing neither mitmproxy nor SQLAlchemy: the policy, the verdict,
the destination guard."""
