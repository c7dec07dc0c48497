"""What credproxy says about what it does: the audit stream, metrics, the admin listener,
problem documents."""
