"""A client of a running role: health, and of main streamed generation, alignment, cancel, stop.

This is how anything outside the runtime talks to it — the local launcher, and the agent
that runs a role on a box (its health probes; on main's box the generations too). It
connects one DEALER link to the role's inbox and speaks the messages of
``inference.wire.runtime``; every wait is bounded. It holds the keys of the role seat's client
(``inference.runtime.curve.client_keys``) and is named "client:<suffix>", so that several clients
of one seat can be connected at once (``inference.runtime.permissions``).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator

from inference.runtime.curve import EndpointKeys
from inference.runtime.permissions import client_name
from inference.runtime.transport import Endpoint
from inference.wire.generation import Done, Failed, Generate, Token
from inference.wire.runtime import Cancel, Ping, Pong, SetAlignment, Shutdown


class GenerationError(RuntimeError):
    """Main refused or could not finish a generation; the message is main's reason.

    ``busy``: main's batch and queue were full, so the generation never started;
    ``too_many_generations``: its user already had the most generations one user may have in
    main (``DeploymentSettings.max_per_user``), so it never started either.
    """

    def __init__(self, message: str, *, busy: bool = False, too_many_generations: bool = False) -> None:
        super().__init__(message)
        self.busy = busy
        self.too_many_generations = too_many_generations


class RuntimeClient:
    """A client of role ``role`` (main unless said) at ``address``. ``curve``: the role seat's client
    keys (no role admits anyone without them); ``name``: the suffix of this client's
    "client:<suffix>" (a random one unless given)."""

    def __init__(
        self, address: str, deployment: str, *, curve: EndpointKeys, role: str = "main", name: str | None = None
    ) -> None:
        self.role = role
        self.endpoint = Endpoint(client_name(name or uuid.uuid4().hex[:8]), deployment, curve=curve)
        self.endpoint.connect(role, address)
        self._nonces = itertools.count(1)

    def ping(self, timeout_s: float = 0.5) -> Pong | None:
        """The role's answer to this ping, or None if it did not come in time.

        Pings sent while the role was still starting wait in its inbox and are all answered once
        it is up; those answers are read past (each Pong carries its Ping's nonce), so that a
        caller never acts on a stale one, nor keeps a backlog of them cycling.
        """
        nonce = next(self._nonces)
        self.endpoint.send(self.role, Ping(nonce=nonce))
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            received = self.endpoint.recv(timeout_s=remaining)
            if received is not None and isinstance(received.msg, Pong) and received.msg.nonce == nonce:
                return received.msg
        return None

    def wait_ready(self, timeout_s: float, *, check: Callable[[], None] | None = None, interval_s: float = 0.1) -> None:
        """Block until main reports every peer ready; ``check`` runs between tries, at most one per ``interval_s``."""
        deadline = time.monotonic() + timeout_s
        detail = "no answer from main yet"
        while (now := time.monotonic()) < deadline:
            if check is not None:
                check()
            pong = self.ping()
            if pong is not None:
                if pong.ready:
                    return
                detail = pong.detail
            time.sleep(max(0.0, min(interval_s - (time.monotonic() - now), deadline - time.monotonic())))
        raise TimeoutError(f"the runtime was not ready within {timeout_s:.0f} s: {detail}")

    def stream(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        user: str = "",
        prefix_namespace: str = "",
        request_id: str | None = None,
        grammar: str = "",
        timeout_s: float = 600.0,
        idle: Callable[[], None] | None = None,
    ) -> Iterator[Token | Done]:
        """Send a generation and yield its tokens as they come, then the final result.

        ``grammar``: the answer keeps to it (``Generate.grammar``); ``user`` and ``prefix_namespace``:
        whose prefix-cache blocks it may reuse (``Generate.user``).

        ``idle`` runs whenever nothing arrived for half a second (e.g. to check that the
        role processes are alive). Raises GenerationError with main's reason.
        """
        request = Generate(
            request_id=request_id or uuid.uuid4().hex[:12],
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            user=user,
            prefix_namespace=prefix_namespace,
            grammar=grammar,
        )
        return self.stream_request(request, timeout_s=timeout_s, idle=idle)

    def stream_request(
        self, request: Generate, *, timeout_s: float = 600.0, idle: Callable[[], None] | None = None
    ) -> Iterator[Token | Done]:
        """``stream`` for a ``Generate`` made elsewhere (the control plane's, which the agent hands on as it is)."""
        request_id = request.request_id
        self.endpoint.send(self._main("generations"), request)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            received = self.endpoint.recv(timeout_s=0.5)
            if received is None:
                if idle is not None:
                    idle()
                continue
            msg = received.msg
            if getattr(msg, "request_id", None) != request_id:
                continue  # a late answer to an earlier request
            if isinstance(msg, Token):
                yield msg
            elif isinstance(msg, Done):
                yield msg
                return
            elif isinstance(msg, Failed):
                raise GenerationError(msg.error, busy=msg.busy, too_many_generations=msg.too_many_generations)
        raise GenerationError(f"the generation did not finish within {timeout_s:.0f} s")

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        on_token: Callable[[int], None] | None = None,
        during: Callable[[int], None] | None = None,
        **kwargs,
    ) -> Done:
        """Generate and return the result; ``during(n)`` runs after the n-th token arrives."""
        for event in self.stream(prompt_ids, max_new_tokens, **kwargs):
            if isinstance(event, Done):
                return event
            if on_token is not None:
                on_token(event.token_id)
            if during is not None:
                during(event.index + 1)
        raise AssertionError("unreachable: stream ends with Done or raises")

    def set_alignment(self, token_period: int, kv_period: int) -> None:
        """New shadow alignment periods, from main's next step on (also mid-generation)."""
        self.endpoint.send(
            self._main("alignment periods"), SetAlignment(token_period=token_period, kv_period=kv_period)
        )

    def cancel(self, request_id: str) -> None:
        """Stop a running generation after its current step (finish_reason "cancelled")."""
        self.endpoint.send(self._main("cancels"), Cancel(request_id=request_id))

    def shutdown(self) -> None:
        """Ask main to stop, and with it every role it is linked to."""
        self.endpoint.send(self._main("a shutdown"), Shutdown())

    def _main(self, what: str) -> str:
        if self.role != "main":
            raise ValueError(f"only main takes {what} from its client; this client talks to {self.role}")
        return self.role

    def close(self, linger_ms: int = 0) -> None:
        """Close the link; ``linger_ms`` gives messages still queued (a cancel) time to leave."""
        self.endpoint.close(linger_ms)
