from django.contrib import admin

from .models import JoinToken, Node


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "status", "address", "enrolled_at", "last_seen"]
    readonly_fields = ["id", "secret_hash", "enrolled_at", "last_seen", "join_token"]


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "created_by", "expires_at", "uses", "max_uses", "revoked"]
    readonly_fields = ["token_hash", "prefix", "created_at", "uses"]
