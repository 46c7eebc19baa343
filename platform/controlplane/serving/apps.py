from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "controlplane.serving"
    label = "serving"
    verbose_name = "Serving (completions, jobs, OpenAI API)"
