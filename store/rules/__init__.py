"""What the store checks before it writes: the grammar, validation, minted-token specs,
AWS names."""
