"""Code that runs inside a training process: recipe loading, the fit loop, events.

Started by the launcher as ``python -m distrun.runtime``; not imported by the
control plane.
"""

__all__: list[str] = []
