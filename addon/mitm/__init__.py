"""Patches of mitmproxy's internals, where it has no hook: each module says which mitmproxy
behaviour it replaces and why."""
