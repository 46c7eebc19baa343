"""``manage.py create_api_key USERNAME [--name NAME] [--scope S ...] [--expires-days N]
[--daily-token-quota N] [--prefix-namespace NAME]``: print a new API key, once."""

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from controlplane.accounts.scopes import ALL_SCOPES, ScopeError
from controlplane.accounts.services import create_api_key


class Command(BaseCommand):
    help = "Create an API key for USERNAME (use it as 'Authorization: Bearer KEY'); it is shown only once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="what the key is for")
        parser.add_argument(
            "--scope",
            action="append",
            choices=ALL_SCOPES,
            dest="scopes",
            help="what the key may do (repeat for several); default: every scope the user may hold",
        )
        parser.add_argument("--expires-days", type=int, default=None, help="default: the key never expires")
        parser.add_argument(
            "--daily-token-quota",
            type=int,
            default=None,
            help="prompt and completion tokens the key may use per UTC day; default: unlimited",
        )
        parser.add_argument(
            "--prefix-namespace",
            default="",
            help="share the prefix cache with every key of this namespace (a common system prompt; each can "
            "tell from cached_tokens what the others' prompts began with); default: the user's own",
        )

    def handle(
        self, *args, username: str, name: str, scopes, expires_days, daily_token_quota, prefix_namespace, **options
    ) -> None:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}; create one with 'manage.py createsuperuser'")
        if not user.is_active:
            raise CommandError(f"user {username!r} is not active")
        if expires_days is not None and expires_days < 1:
            raise CommandError("--expires-days must be 1 or more")
        expires_at = timezone.now() + timedelta(days=expires_days) if expires_days else None
        try:
            # Keyword-argument call whose names line up with client.py's Generate(...)
            # and deployments/services.py's sim.estimate(...): different calls, alike by shape only.
            _, clear = create_api_key(
                user=user,
                name=name,
                scopes=scopes,
                expires_at=expires_at,
                daily_token_quota=daily_token_quota,
                prefix_namespace=prefix_namespace,
            )
        except (ScopeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(clear)
