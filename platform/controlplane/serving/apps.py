from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "controlplane.serving"
    label = "serving"
    verbose_name = "Serving (completions, jobs, OpenAI API)"

    def ready(self) -> None:
        from django.conf import settings
        from django.db import transaction
        from django.db.models.signals import post_save

        from controlplane.accounts import signals

        from . import jobs

        # After the change commits (the admin saves a user inside a transaction): a job is never
        # cancelled for a revocation or deactivation that rolled back.
        def on_revoked(sender, *, key_id: int, **kwargs) -> None:
            transaction.on_commit(lambda: jobs.stop_jobs(api_key_id=key_id))

        def on_user_saved(sender, *, instance, **kwargs) -> None:
            if not instance.is_active:
                transaction.on_commit(lambda: jobs.stop_jobs(owner_id=instance.pk))

        signals.api_key_revoked.connect(on_revoked, weak=False, dispatch_uid="serving.stop-revoked")
        post_save.connect(on_user_saved, sender=settings.AUTH_USER_MODEL, weak=False, dispatch_uid="serving.stop-user")
