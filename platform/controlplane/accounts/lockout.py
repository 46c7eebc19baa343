"""Login lockout with two limits: one username from one address, and one username from anywhere.

django-axes counts failed logins in the database and compares the largest count over its
lockout parameters with one limit. Two limits are wanted here: a few failures lock a
username out from the address they came from (``AXES_FAILURE_LIMIT``, 5), and more failures
from any addresses lock the username out everywhere (``LOGIN_USERNAME_FAILURE_LIMIT``, 20),
so that a guesser who spreads over many addresses still gets only so many tries per
cool-off. ``AXES_LOCKOUT_PARAMETERS`` lists the pair, then the username alone; this handler
reads the two counts apart.

Why this way: the username-wide count is expressed in units of the pair's limit (20 failures
count as 5), so axes's own lockout decision (``failures >= AXES_FAILURE_LIMIT``, made in the
login that fails, and in the check before every login) applies both limits unchanged. A
successful login resets only its own address's count: the owner logging in must not wipe
out what a guesser elsewhere has spent.
"""

from __future__ import annotations

from axes.handlers.database import AxesDatabaseHandler
from django.conf import settings
from django.db.models import Sum


class LockoutHandler(AxesDatabaseHandler):
    def get_failures(self, request, credentials: dict | None = None) -> int:
        """Failures measured against ``AXES_FAILURE_LIMIT``: the pair's own, or the username's
        across every address scaled so that ``LOGIN_USERNAME_FAILURE_LIMIT`` of them reach it."""
        pair, username = (self._count(attempts) for attempts in self.get_user_attempts(request, credentials))
        pair_limit, username_limit = settings.AXES_FAILURE_LIMIT, settings.LOGIN_USERNAME_FAILURE_LIMIT
        # floor(u * p / U) >= p exactly when u >= U: the integer scaling keeps both thresholds exact.
        return max(pair, username * pair_limit // username_limit)

    def reset_user_attempts(self, request, credentials: dict | None = None) -> int:
        """A success clears the failures of its own username and address only."""
        pair = self.filter_user_attempts(request, credentials)[0]
        count, _ = pair.delete()
        return count

    @staticmethod
    def _count(attempts) -> int:
        return attempts.aggregate(Sum("failures_since_start"))["failures_since_start__sum"] or 0
