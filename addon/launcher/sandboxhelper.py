"""The helper inside `exec --isolate`'s sandbox: listen on the proxy's port, hand the
listening socket out, become CMD.

Standard library only: exec runs this file's text with `python3 -I -c`, with an interpreter
the sandbox's user can run, so nothing of credproxy's installation has to be visible inside.
Arguments: the inherited socket pair's fd, the port, `--`, CMD.
"""

from __future__ import annotations

import array
import os
import signal
import socket
import struct
import sys
from collections.abc import Sequence

CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def main(argv: Sequence[str]) -> int:
    fd, port, _, *command = argv
    with socket.socket(fileno=int(fd)) as control:
        listener = socket.create_server(("127.0.0.1", int(port)), backlog=64)
        credentials = CRED.pack(os.getpid(), os.getuid(), os.getgid())
        control.sendmsg(
            [b"x"],
            [
                (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [listener.fileno()])),
                (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, credentials),
            ],
        )
    listener.close()
    # Nothing but stdin, stdout and stderr reaches CMD: a descriptor exec or its caller
    # passed down (a folder's, above all) would lead out of the sandbox's mounts.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    for number in (signal.SIGPIPE, signal.SIGXFSZ):  # as exec's own spawn resets them
        signal.signal(number, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)  # noqa: S606 - CMD as given, no shell
    except FileNotFoundError:
        print(f"credproxy: error: cannot run {command[0]!r}: command not found", file=sys.stderr)
        return 127
    except OSError as e:
        print(f"credproxy: error: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
