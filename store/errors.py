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


class CredproxyError(Exception):
    """Base of every error credproxy reports to an operator."""


class InvalidInput(CredproxyError):
    pass


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
