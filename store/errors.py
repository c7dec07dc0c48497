"""The exception tree shared by the store, the CLI and the proxy.

    CredproxyError
    ├── InvalidInput        bad operator input (names, hosts, patterns, durations)
    ├── NotFound            an unknown principal, credential or grant
    ├── Conflict            a duplicate name
    ├── MasterKeyError      the master key is missing, wrong, or its file is unsafe
    ├── SealError           a sealed secret failed authentication
    └── StoreUnavailable    the database cannot be reached

Messages are one line, never carry a secret, and name the database without its password.
"""

from collections.abc import Mapping


class CredproxyError(Exception):
    """Base of every error credproxy reports to an operator."""


class InvalidInput(CredproxyError):
    """Bad input. The message may name inputs as {placeholders}, each given its plain name.

    str() reads the plain names; worded() reads the caller's own (the CLI's flags).
    """

    def __init__(self, message: str, **inputs: str) -> None:
        super().__init__(message.format_map(inputs) if inputs else message)
        self._template = message
        self._inputs = inputs

    def worded(self, names: Mapping[str, str]) -> str:
        if not self._inputs:
            return str(self)
        return self._template.format_map({k: names.get(k, v) for k, v in self._inputs.items()})


class NotFound(CredproxyError):
    pass


class Conflict(CredproxyError):
    pass


class MasterKeyError(CredproxyError):
    pass


class SealError(CredproxyError):
    pass


class StoreUnavailable(CredproxyError):
    pass
