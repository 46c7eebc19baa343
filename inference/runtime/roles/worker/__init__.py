"""The worker role: keep owned experts in host memory or on disk, load the predicted ones just in time.

The role's loop and message handling are in ``role``; what a session knows of its sequences
and predictions in ``session``; the store and loader a worker opens in ``storage``; a request's
checks and units in ``requests``; hybrid execution's decisions and CPU path in ``hybrid``; the
hot store's pins and the session's stats in ``stats``.
"""

from inference.runtime.roles.worker.requests import received_ms
from inference.runtime.roles.worker.role import WorkerRole, serve
from inference.runtime.roles.worker.session import MAX_JOINED, MAX_PREDICTED, Session, session_step

__all__ = ["MAX_JOINED", "MAX_PREDICTED", "Session", "WorkerRole", "received_ms", "serve", "session_step"]
