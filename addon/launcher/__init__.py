"""`credproxy exec` and `credproxy env`: sessions, the contained environment, the sandbox."""
