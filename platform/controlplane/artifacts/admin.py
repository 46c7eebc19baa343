from django.contrib import admin

from .models import ModelArtifact


@admin.register(ModelArtifact)
class ModelArtifactAdmin(admin.ModelAdmin):
    list_display = ["name", "path", "shard_status", "shard_workers", "created_at"]
    readonly_fields = ["summary", "total_bytes", "shard_done_bytes", "shard_total_bytes", "shard_error"]
