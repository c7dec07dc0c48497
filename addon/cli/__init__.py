"""The operator's CLI: parse once, call one function, print one line or exit 2."""
