"""Every list endpoint pages the same way: ``?limit=N&offset=M`` (DRF's limit/offset), at most
``MAX_PAGE`` rows a page.

Why a most: a list's rows can be large (a job output keeps its prompt, its answer and its metrics'
summary), and without one ``?limit=1000000`` would have the web process build the whole list in
memory at once, which is what paging is for. A larger ``limit`` is taken as ``MAX_PAGE`` (DRF's
``max_limit``), and ``next`` leads on, as for any page.
"""

from __future__ import annotations

from django.db.models import QuerySet
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer

MAX_PAGE = 200  # four default pages (PAGE_SIZE, 50): a page of job outputs stays within a few MB


class Pages(LimitOffsetPagination):
    max_limit = MAX_PAGE


def paginated(request: Request, queryset: QuerySet, serializer_class: type[Serializer]) -> Response:
    """``{"count", "next", "previous", "results"}`` for one page of ``queryset``."""
    paginator = Pages()
    page = paginator.paginate_queryset(queryset, request)
    return paginator.get_paginated_response(serializer_class(page, many=True).data)
