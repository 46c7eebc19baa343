"""``Authorization: Bearer KEY`` for programs, with keys from ``manage.py create_api_key``."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from .services import authenticate_api_key


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        found = authenticate_api_key(key=key.strip()) if key.strip() else None
        if found is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return found.user, found

    def authenticate_header(self, request) -> str:
        return "Bearer"
