"""What the accounts app tells other apps, without knowing them (the serving app listens).

``api_key_revoked``: this key stopped working just now (sent once the revocation is saved), so
what it started and is still to run stops too. A user's deactivation needs no signal of its
own: Django's ``post_save`` of the user model carries it.
"""

from django.dispatch import Signal

api_key_revoked = Signal()  # kwargs: key_id
