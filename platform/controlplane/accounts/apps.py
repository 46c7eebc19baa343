from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "controlplane.accounts"
    label = "accounts"
    verbose_name = "API keys"
