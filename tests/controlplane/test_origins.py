"""Browser websockets (chat, console) open only from a page of this site: scheme, host and port, or a
trusted origin, as Django's CSRF check takes a form's origin."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.config.asgi import application
from controlplane.origins import same_origin


@pytest.mark.parametrize(
    ("origin", "host", "secure", "trusted", "taken"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", False, [], True),
        ("http://127.0.0.1:9999", "127.0.0.1:8000", False, [], False),  # another program on the same machine
        ("http://127.0.0.1", "127.0.0.1:8000", False, [], False),
        ("http://127.0.0.1:80", "127.0.0.1", False, [], True),  # the scheme's own port, said or not
        ("https://example.com", "example.com:443", True, [], True),
        ("http://example.com", "example.com", True, [], False),  # a plain-http page of an https site
        ("https://example.com", "example.com", False, [], False),
        ("https://EXAMPLE.com", "example.com", True, [], True),
        ("https://evil.example", "example.com", True, [], False),
        ("https://console.example.org", "example.com", True, ["https://console.example.org"], True),
        ("https://a.example.org", "example.com", True, ["https://*.example.org"], True),
        ("http://a.example.org", "example.com", True, ["https://*.example.org"], False),
        ("https://example.org.evil", "example.com", True, ["https://*.example.org"], False),
        (None, "example.com", True, [], False),
        ("null", "example.com", True, [], False),
        ("https://example.com/page", "example.com", True, [], False),
        ("https://example.com:99999", "example.com", True, [], False),
    ],
)
def test_an_origin_is_taken_only_with_the_requests_own_scheme_host_and_port_or_as_trusted(
    origin, host, secure, trusted, taken
) -> None:
    assert same_origin(origin, host=host, secure=secure, trusted=trusted) is taken


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/ws/chat/", "/ws/console/"])
def test_a_logged_in_browsers_socket_opens_only_from_a_page_of_this_site(
    channel_layer_on_test_redis, settings, path: str
) -> None:
    browser = Client()
    browser.force_login(get_user_model().objects.create_user("staff", is_staff=True))
    cookie = (b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode())

    def opens(origin: str, host: str = "127.0.0.1:8000", *extra: tuple[bytes, bytes]) -> bool:
        async def attempt() -> bool:
            headers = [(b"origin", origin.encode()), (b"host", host.encode()), cookie, *extra]
            comm = WebsocketCommunicator(application, path, headers=headers)
            connected, _ = await comm.connect()
            await comm.disconnect()
            return connected

        return async_to_sync(attempt)()

    assert opens("http://127.0.0.1:8000")
    assert not opens("http://127.0.0.1:9999")  # taken before: the host name alone was compared
    assert not opens("https://127.0.0.1:8000")
    assert not opens("http://evil.example:8000", "evil.example:8000")  # a host the site does not serve
    settings.CSRF_TRUSTED_ORIGINS = ["http://127.0.0.1:9999"]
    assert opens("http://127.0.0.1:9999")
    # Behind the TLS proxy, which says the request came over https.
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert opens("https://127.0.0.1", "127.0.0.1", (b"x-forwarded-proto", b"https"))
    assert not opens("http://127.0.0.1", "127.0.0.1", (b"x-forwarded-proto", b"https"))
