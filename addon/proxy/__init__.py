"""The mitmproxy addons in chain order, and the per-flow state they share."""
