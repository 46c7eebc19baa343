from django.contrib import admin
from django.utils import timezone

from .models import ApiKey
from .services import revoke_api_key


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = [
        "user",
        "name",
        "prefix",
        "scopes",
        "prefix_namespace",
        "created_at",
        "expires_at",
        "last_used",
        "revoked",
    ]
    list_filter = ["revoked"]
    readonly_fields = ["key_hash", "prefix", "created_at", "last_used", "revoked", "revoked_at"]
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:
        return False  # a key is made where its clear value can be shown: the API keys page, the API or create_api_key

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset) -> None:
        for key in queryset.filter(revoked=False):
            revoke_api_key(key=key)
        self.message_user(request, f"revoked at {timezone.now():%Y-%m-%d %H:%M:%S}")
