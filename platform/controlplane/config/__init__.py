"""Project configuration: settings per purpose, URLs, ASGI/WSGI entry points."""
