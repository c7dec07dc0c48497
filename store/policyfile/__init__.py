"""Policy files: parsed, and reconciled against the store."""
