"""The worker server: one per host, model-agnostic, reached only through authenticated frames.

Started by ``distrun up`` as ``python -m distrun.server start`` (over SSH, or as
a local process for the embedded default). It imports neither torch nor the
client: a broken CUDA install cannot take it down, and it starts in a fraction
of a second. See docs/cluster.md for the security model.
"""

from distrun.server._server import WorkerServer
from distrun.protocol.cluster import ServerState
from distrun.server._state import StateDir

__all__ = ["WorkerServer", "ServerState", "StateDir"]
