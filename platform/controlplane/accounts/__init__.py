"""Accounts: API keys for programs (``Authorization: Bearer KEY``), beside Django's users."""
