"""What the control plane sends down an agent link fits the frame that agent takes.

An agent announces, when it connects, the most bytes one frame to it may hold
(``inference.wire.link.frame_limit``; one that announces nothing is held to
websockets' default, 1 MiB). A bigger frame would make the agent's websocket close the link with
1009 (message too big), and every generation on that link would fail with it. So the link's
consumer measures each frame before it sends it, and a frame that would not fit is not sent: what
it asked for fails alone, as the agent would have said it (``refusal``) — a generation with
``Failed(too_large=True)``, which its caller's API reports as a request too large (the OpenAI API's
400 ``request_too_large``), a shard fetch or a role start as a failed task, which the deployment
reports; anything else is only logged.

Why measured at the link and not where a command is made: the limit belongs to the link that is
open now, which only its consumer holds, and every command reaches an agent through it (services,
Celery tasks and the generation service all send through the node's channel-layer group).
"""

from __future__ import annotations

from inference.wire.generation import Failed, Generate
from inference.wire.link import FetchShard, StartRole, TaskDone

TASK_COMMANDS = (FetchShard.TAG, StartRole.TAG)  # commands whose outcome the agent reports as TaskDone


def too_large(kind: str, size: int, limit: int) -> str:
    """Why a frame was not sent: its size and the agent's limit, both in bytes."""
    return (
        f"the {kind} takes {size} bytes on the link to its node, more than the {limit} bytes that node's agent "
        "takes in one frame"
    )


def refusal(command: dict, size: int, limit: int) -> Failed | TaskDone | None:
    """What a command of ``size`` bytes, past the agent's ``limit``, fails instead of being sent, as
    the agent's own answer would say it; None for a command nobody waits on."""
    kind = command.get("type")
    if kind == Generate.TAG:
        reason = too_large("request", size, limit) + ": make it smaller (its prompt, schema or grammar)"
        return Failed(request_id=str(command.get("request_id", "")), error=reason, too_large=True)
    if kind in TASK_COMMANDS:
        return TaskDone(
            task_id=str(command.get("task_id", "")), ok=False, detail=too_large(f"{kind} command", size, limit)
        )
    return None
