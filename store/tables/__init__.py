"""One module per table."""
