"""The odmoe control plane: a Django project that enrolls GPU boxes and runs the cluster."""

# Load the Celery app with Django so that ``@shared_task`` binds to it.
from .config.celery_app import app as celery_app

__all__ = ["celery_app"]
