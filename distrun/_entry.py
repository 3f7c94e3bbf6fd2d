"""The ``distrun`` command's entry point (the console script and ``python -m distrun``).

Before anything is imported: paramiko imports invoke (with asyncio and unittest.mock, 40 ms
of every command) only to run an ssh_config's "Match exec", and distrun reads no ssh_config
through paramiko. So the command keeps it out; a process that imports distrun as a library
(or had invoke already) is left alone.
"""

import sys


def main() -> None:
    sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]
    from distrun.cli import run

    run()
