from django.contrib import admin

from .models import Deployment, DeploymentNode


class MemberInline(admin.TabularInline):
    model = DeploymentNode
    extra = 0


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "model",
        "status",
        "shadow_dtype",
        "token_period",
        "kv_period",
        "strategy",
        "predictor",
        "max_batch",
        "max_per_user",
        "expert_codec",
        "created_at",
    ]
    inlines = [MemberInline]
