from django.urls import path

from . import api, views

urlpatterns = [
    path("api/keys", api.KeyListApi.as_view(), name="keys"),
    path("api/keys/<int:key_id>", api.KeyDetailApi.as_view(), name="key-detail"),
    path("keys/", views.keys_page, name="keys-page"),
]
