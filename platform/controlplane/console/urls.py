from django.urls import path

from . import views

urlpatterns = [
    path("console/", views.console, name="console"),
    path("console/state.json", views.state, name="console-state"),
]
