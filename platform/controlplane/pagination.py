"""Every list endpoint pages the same way: ``?limit=N&offset=M`` (DRF's limit/offset)."""

from __future__ import annotations

from django.db.models import QuerySet
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer


def paginated(request: Request, queryset: QuerySet, serializer_class: type[Serializer]) -> Response:
    """``{"count", "next", "previous", "results"}`` for one page of ``queryset``."""
    paginator = LimitOffsetPagination()
    page = paginator.paginate_queryset(queryset, request)
    return paginator.get_paginated_response(serializer_class(page, many=True).data)
