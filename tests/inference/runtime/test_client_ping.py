"""RuntimeClient's health pings against a main that starts late: stale answers are read past, not kept."""

from __future__ import annotations

import threading
import time

from inference.runtime.client import RuntimeClient
from inference.runtime.curve import client_keys, new_seat_keys, role_keys
from inference.runtime.launcher import free_port
from inference.runtime.transport import Endpoint
from inference.wire.runtime import Ping, Pong

DEPLOYMENT = "dep-ping"


def test_ping_reads_past_the_answers_to_pings_sent_before_main_was_up() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    seats = new_seat_keys(["main", "worker-0"])
    client = RuntimeClient(address, DEPLOYMENT, curve=client_keys("main", seats))
    stop = threading.Event()
    answered: list[int] = []

    def main_role() -> None:  # answers every ping in order: "answer N", ready from the 6th on
        main = Endpoint("main", DEPLOYMENT, bind=address, curve=role_keys("main", seats))
        try:
            while not stop.is_set():
                got = main.recv(0.05)
                if got is not None and isinstance(got.msg, Ping):
                    answered.append(len(answered) + 1)
                    n = answered[-1]
                    reply = Pong(role="main", ready=n >= 6, detail=f"answer {n}", nonce=got.msg.nonce)
                    main.reply(got.identity, reply)
        finally:
            main.close()

    try:
        for _ in range(5):  # main is not up yet: these wait in the client's link
            assert client.ping(timeout_s=0.02) is None
        thread = threading.Thread(target=main_role, daemon=True)
        thread.start()
        deadline = time.monotonic() + 5
        while len(answered) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the five answers to the backlog are all at the client now
        # The five answers to the backlog are here first; ping() reads past them to its own.
        pong = client.ping(timeout_s=2)
        assert pong is not None and pong.ready and pong.detail == "answer 6"
        assert client.ping(timeout_s=2).detail == "answer 7"
    finally:
        stop.set()
        client.close()
