from django.contrib import admin

from .models import SETTINGS_COLUMNS, Deployment, DeploymentNode


class MemberInline(admin.TabularInline):
    model = DeploymentNode
    extra = 0


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["name", "model", "status", *SETTINGS_COLUMNS, "created_at"]
    inlines = [MemberInline]
