"""`distrun dashboard`: the jobs, ranks and hosts of this machine and its clusters on a web page.

Another client of the same servers and job records as the CLI (``client``), served by the
standard library's HTTP server with its page shipped in the package (``static/``): nothing
to install, nothing fetched from the internet. Guarded by a token first (``_guard``).
"""

from distrun.dashboard._guard import Guard, Verdict
from distrun.dashboard._kept import KeptSource
from distrun.dashboard._server import Dashboard
from distrun.dashboard._source import Source
from distrun.dashboard._sources import Sources, Unloaded

__all__ = ["Dashboard", "Guard", "KeptSource", "Source", "Sources", "Unloaded", "Verdict"]
