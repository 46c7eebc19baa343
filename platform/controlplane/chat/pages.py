"""How many chat pages (open chat sockets) each user holds in this web process: at most
``settings.CHAT_PAGES_PER_USER``.

An open chat socket holds a file descriptor of its web process and, while it follows an answer, a
Redis connection blocked on the answer's tape (``chat.tape.follow``): one user opening pages without
end would run the process out of both, and every other user's chat with it. A socket past the bound
is accepted and closed at once with ``CLOSE_TOO_MANY_PAGES`` and a reason the page shows (a browser
is told a close code only once the socket was accepted); the user's other pages go on, and so does
everyone else's. Counted per process: a web process that stops takes its count with it, and a
deployment of N web processes holds one user to N times the bound.
"""

from __future__ import annotations

import threading
from collections import Counter

from django.conf import settings

CLOSE_TOO_MANY_PAGES = 4429  # 4000 + HTTP's 429, as CLOSE_UNAUTHENTICATED is 4000 + 401

_open: Counter[int] = Counter()  # user id -> chat sockets open in this process
_lock = threading.Lock()  # sockets of one process may run on several event loops (tests do)


def enter(user_id: int) -> bool:
    """Count one more page of ``user_id``'s, unless they hold the most already (False: refuse it)."""
    with _lock:
        if _open[user_id] >= settings.CHAT_PAGES_PER_USER:
            return False
        _open[user_id] += 1
        return True


def leave(user_id: int) -> None:
    """One page of ``user_id``'s, counted by ``enter``, closed."""
    with _lock:
        _open[user_id] -= 1
        if _open[user_id] <= 0:
            del _open[user_id]


def open_pages(user_id: int) -> int:
    """The chat sockets ``user_id`` holds open in this process now."""
    with _lock:
        return _open[user_id]


def too_many() -> str:
    """The close reason a refused page shows (a close reason holds at most 123 bytes)."""
    return f"at most {settings.CHAT_PAGES_PER_USER} chat pages open at once; close one and this one connects"
