"""What one chat page holds in its web process. One user's pages are bounded
(``controlplane.chat.pages``): past ``CHAT_PAGES_PER_USER`` a page is accepted and closed at once
with 4429 and the reason the page shows, and nothing it sends is read; the user's other pages go
on, another user's page still connects, and a page that closes frees its place. And a page takes no
channel of the channel layer, whose receive, cancelled as the socket closes, could lose another
answer's token."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model

from controlplane.chat import pages
from controlplane.chat.consumers import ChatConsumer

pytestmark = pytest.mark.django_db(transaction=True)


def page(user) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(ChatConsumer.as_asgi(), "/ws/chat/")
    comm.scope["user"] = user
    return comm


def test_a_user_past_the_bound_is_refused_a_page_while_their_others_and_other_users_go_on(settings) -> None:
    settings.CHAT_PAGES_PER_USER = 2
    alice = get_user_model().objects.create_user("alice")
    bob = get_user_model().objects.create_user("bob")

    async def scenario() -> None:
        first, second, third = page(alice), page(alice), page(alice)
        assert (await first.connect())[0] and (await second.connect())[0]
        assert (await third.connect())[0]  # accepted, so that the browser is told why it closes
        closed = await third.receive_output(timeout=5)
        assert closed == {"type": "websocket.close", "code": 4429, "reason": pages.too_many()}
        assert "at most 2 chat pages" in closed["reason"] and len(closed["reason"].encode()) <= 123
        await third.send_json_to({"type": "send", "conversation": None, "content": "hi", "max_tokens": 4})
        assert await third.receive_nothing(timeout=0.5)  # a refused page's messages are not read
        await third.disconnect()
        assert pages.open_pages(alice.pk) == 2  # the refused page never counted, so leaves nothing

        others = page(bob)
        assert (await others.connect())[0]  # another user is not held to alice's count
        await second.send_to(text_data="not json")  # alice's open pages still answer
        assert (await second.receive_json_from(timeout=5))["type"] == "error"

        await first.disconnect()
        again = page(alice)
        assert (await again.connect())[0]  # a closed page freed its place
        assert await again.receive_nothing(timeout=0.2)
        for comm in (again, second, others):
            await comm.disconnect()
        assert (pages.open_pages(alice.pk), pages.open_pages(bob.pk)) == (0, 0)

    async_to_sync(scenario)()


def test_a_chat_page_takes_no_channel_of_the_channel_layer(channel_layer_on_test_redis) -> None:
    """The layer is configured (agent links and generations use it), and the chat's consumer gets
    none: no channel of its own, so no receive of its own to cancel when it closes."""
    from channels.layers import get_channel_layer

    user = get_user_model().objects.create_user("carol")
    opened: list[ChatConsumer] = []

    class Seen(ChatConsumer):
        async def connect(self) -> None:
            opened.append(self)
            await super().connect()

    async def scenario() -> None:
        comm = WebsocketCommunicator(Seen.as_asgi(), "/ws/chat/")
        comm.scope["user"] = user
        assert (await comm.connect())[0]
        await comm.send_to(text_data="not json")
        assert (await comm.receive_json_from(timeout=5))["type"] == "error"  # served as before
        await comm.disconnect()

    assert get_channel_layer() is not None
    async_to_sync(scenario)()
    (consumer,) = opened
    assert consumer.channel_layer is None and not hasattr(consumer, "channel_name")
