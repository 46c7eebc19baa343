"""``manage.py join_token --server URL [--name N] [--max-uses N] [--ttl-s S] [--json]``: a new join
token and the one-liner that enrolls a box with it, for scripts (the console's Enroll form does the
same through the API)."""

import json

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from agent.tls import check_server_url
from controlplane.nodes.services import create_join_token
from controlplane.nodes.tls import enroll_commands


class Command(BaseCommand):
    help = (
        "Create a join token and print the install one-liner that enrolls a box with it (shown only once). "
        "--server is the URL the boxes reach the control plane at: https://HOST behind the TLS proxy."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--server", required=True, help="the control plane's URL as the boxes reach it")
        parser.add_argument("--name", default="", help="what the token is for")
        parser.add_argument("--max-uses", type=int, default=1, help="how many boxes it may enroll (default 1)")
        parser.add_argument("--ttl-s", type=int, default=None, help="its lifetime in seconds (default: the setting)")
        parser.add_argument(
            "--json", action="store_true", dest="as_json", help="print the token, the commands and any warning"
        )

    def handle(self, *args, server: str, name: str, max_uses: int, ttl_s, as_json: bool, **options) -> None:
        try:
            # Plain http off loopback is not refused here: the warning says agents need --insecure for it.
            server = check_server_url(server, insecure=True)
            enroll_commands(server, "")  # an unusable certificate file fails before a token is made
            _, clear = create_join_token(created_by=None, name=name, ttl_s=ttl_s, max_uses=max_uses)
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from None
        commands = enroll_commands(server, clear)
        if as_json:
            self.stdout.write(json.dumps({"token": clear, **commands}, indent=2))
            return
        if commands["warning"]:
            self.stderr.write(f"warning: {commands['warning']}")
        self.stdout.write(commands["install_command"])
