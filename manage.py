#!/usr/bin/env python
"""Django's command-line utility for the odmoe control plane."""

import os
import sys
from pathlib import Path

# The Django project lives in platform/ (which is not a package, so it never shadows the
# standard library's ``platform``): put that folder on the path, after the stdlib.
sys.path.append(str(Path(__file__).resolve().parent / "platform"))


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.config.settings.local")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
