"""The job secret: the one key of a job's data plane.

The client draws 256 random bits per job attempt and hands them to every worker server
inside ``rendezvous``/``submit`` (the control plane: SSH, then the server's HMAC
handshake); a local job's launcher draws its own. Servers and launchers pass it to the
ranks in their environment (readable by the same user only), never on a command line
and never in the job spec, which is written to disk and echoed in logs. Every data-plane
peer proves it holds the secret before it is served: the store's front
(``launch/_store_relay``), the parameter-server channel, the link probe.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping

from distrun.errors import ConfigError
from distrun.protocol.environment import JOB_SECRET_VAR

__all__ = ["SECRET_BYTES", "new_job_secret", "parse_job_secret", "job_secret_from"]

SECRET_BYTES = 32
_HEX = re.compile(r"^[0-9a-f]{64}$")


def new_job_secret() -> str:
    """A fresh secret, as the hex text that travels in requests and environments."""
    return secrets.token_hex(SECRET_BYTES)


def parse_job_secret(text: object, where: str) -> bytes:
    """The secret's bytes; a one-line error naming ``where`` it came from if it is malformed."""
    if not isinstance(text, str) or not _HEX.match(text):
        raise ConfigError(f"{where}: the job secret must be {2 * SECRET_BYTES} lowercase hex digits")
    return bytes.fromhex(text)


def job_secret_from(env: Mapping[str, str]) -> bytes:
    """This process's job secret, from the environment its launcher gave it."""
    return parse_job_secret(env.get(JOB_SECRET_VAR), f"${JOB_SECRET_VAR}")
