"""``manage.py create_api_key USERNAME [--name NAME]``: print a new API key, once."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts.services import create_api_key


class Command(BaseCommand):
    help = "Create an API key for USERNAME (use it as 'Authorization: Bearer KEY'); it is shown only once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="what the key is for")

    def handle(self, *args, username: str, name: str, **options) -> None:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}; create one with 'manage.py createsuperuser'")
        if not user.is_active:
            raise CommandError(f"user {username!r} is not active")
        _, clear = create_api_key(user=user, name=name)
        self.stdout.write(clear)
