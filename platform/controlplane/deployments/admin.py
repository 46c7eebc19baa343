from django.contrib import admin

from .models import SETTINGS_COLUMNS, AnswerPause, Deployment, DeploymentNode


class MemberInline(admin.TabularInline):
    model = DeploymentNode
    extra = 0


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["name", "model", "status", *SETTINGS_COLUMNS, "created_at"]
    inlines = [MemberInline]


@admin.register(AnswerPause)
class AnswerPauseAdmin(admin.ModelAdmin):
    """What the runtime reported: read, never written by hand."""

    list_display = ["created_at", "deployment_name", "cause", "at_token", "paused_ms", "detail", "request_id"]
    list_filter = ["cause", "deployment_name"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
