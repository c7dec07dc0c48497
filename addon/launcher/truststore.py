"""A PKCS12 truststore holding credproxy's CA, for Java; made with keytool where it exists.

cryptography before 45 cannot mark a certificate as trusted in PKCS12 (the attribute Java
looks for), so keytool writes it. Without keytool, Java gets the proxy but not the trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

PASSWORD = "changeit"  # noqa: S105 - a truststore holds only public certificates; Java's usual password


def java_truststore(ca_file: Path, directories: list[Path]) -> Path | None:
    """The truststore for this CA, in the first directory where it exists or can be written."""
    keytool = shutil.which("keytool")
    name = f"credproxy-ca-{hashlib.sha256(ca_file.read_bytes()).hexdigest()[:16]}.p12"
    for directory in directories:
        path = directory / name
        if path.is_file():
            return path
        if keytool is None:
            continue
        tmp = directory / f".{name}.{os.getpid()}"
        try:
            tmp.unlink(missing_ok=True)
            subprocess.run(  # noqa: S603 - a fixed argument list, no shell
                [
                    keytool,
                    "-importcert",
                    "-noprompt",
                    "-alias",
                    "credproxy",
                    "-file",
                    str(ca_file),
                    "-keystore",
                    str(tmp),
                    "-storetype",
                    "PKCS12",
                    "-storepass",
                    PASSWORD,
                ],
                capture_output=True,
                timeout=120,
                check=True,
            )
            os.replace(tmp, path)
            return path
        except (OSError, subprocess.SubprocessError):
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return None
