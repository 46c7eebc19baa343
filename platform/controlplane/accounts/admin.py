from django.contrib import admin

from .models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["user", "name", "prefix", "created_at", "last_used", "revoked"]
    readonly_fields = ["key_hash", "prefix", "created_at", "last_used"]
