"""``Authorization: Bearer KEY`` for programs, with keys from ``manage.py create_api_key``."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from .services import authenticate_api_key, bearer_key


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if header.partition(" ")[0].lower() != "bearer":
            return None
        key = bearer_key(header)
        found = authenticate_api_key(key=key) if key else None
        if found is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return found.user, found

    def authenticate_header(self, request) -> str:
        return "Bearer"
