"""The redactor and its uses: secrets echoed by an upstream reach the agent as [REDACTED]."""
