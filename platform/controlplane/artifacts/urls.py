from django.urls import path

from . import api

urlpatterns = [
    path("models", api.ModelListApi.as_view(), name="models"),
    path("models/<int:model_id>", api.ModelDetailApi.as_view(), name="model-detail"),
    path("models/<int:model_id>/shards", api.ModelShardsApi.as_view(), name="model-shards"),
    path("models/<int:model_id>/shards/<str:role>/<str:name>", api.ShardFileApi.as_view(), name="shard-file"),
]
