"""Settings shared by every environment. Whatever differs comes from the environment:

| variable | meaning | default |
|---|---|---|
| ``DJANGO_SECRET_KEY`` | signing key (required in production) | none; ``local``: its own in ``var/`` |
| ``DJANGO_SECRET_KEY_FALLBACKS`` | earlier keys, comma-separated: still accepted, never used to sign | none |
| ``DJANGO_DEBUG`` | ``1`` to enable debug | off |
| ``DJANGO_ALLOWED_HOSTS`` | comma-separated host names | ``localhost,127.0.0.1`` |
| ``DATABASE_URL`` | e.g. ``postgres://user@127.0.0.1:5432/odmoe`` (docs/database.md) | SQLite under ``ODMOE_VAR_DIR`` |
| ``ODMOE_DB_CONN_MAX_AGE`` | seconds a PostgreSQL connection is kept between requests or tasks | 0 |
| ``ODMOE_VAR_DIR`` | where the control plane keeps its data | ``var/`` in the checkout |
| ``ODMOE_MODELS_DIR`` | where models registered by Hub repo id are downloaded | ``models/`` in ``ODMOE_VAR_DIR`` |
| ``HF_TOKEN`` | Hugging Face token, for gated or private repos (read by ``huggingface_hub``) | none |
| ``ODMOE_JOIN_TOKEN_TTL_S`` | default lifetime of a join token | 86400 |
| ``ODMOE_TLS_CERT_FILE`` | the PEM certificate the TLS proxy presents, which boxes pin (docs/tls.md) | none: no pin |
| ``REDIS_URL`` | Redis for Celery, the Channels layer and the shared cache | ``redis://127.0.0.1:6379/0`` |
| ``ODMOE_NODE_HEARTBEAT_TIMEOUT_S`` | silence after which a node turns offline | 15 |
| ``ODMOE_CHAT_RESUME_GRACE_S`` | how long a chat answer whose page went away waits for it to come back | 20 |
| ``ODMOE_CHAT_PAGES_PER_USER`` | chat pages (sockets) one user may hold open in one web process | 32 |
| ``ODMOE_TASK_REDELIVERY_S`` | a task whose worker died unacknowledged runs again after | 3600 |
| ``ODMOE_LOG_LEVEL`` | log level of every process | INFO |
| ``ODMOE_LOGIN_FAILURE_LIMIT`` | failed logins that lock one username out from one address | 5 |
| ``ODMOE_LOGIN_USER_FAILURE_LIMIT`` | failed logins that lock one username out from every address | 20 |
| ``ODMOE_LOGIN_LOCKOUT_HOURS`` | how long a lockout lasts | 0.25 |
| ``ODMOE_NUM_PROXIES`` | reverse proxies in front that set ``X-Forwarded-For`` (see ``REST_FRAMEWORK``) | 0 |
| ``ODMOE_HSTS_SECONDS``, ``ODMOE_HSTS_INCLUDE_SUBDOMAINS`` | HSTS in production (``1``: subdomains too) | a year, off |
| ``ODMOE_MAX_REQUEST_BYTES`` | the largest request body and websocket frame taken (413 / close 1009) | 16777216 |
| ``ODMOE_THROTTLE_USER`` | API calls per user (REST and ``/v1``) | 600/minute |
| ``ODMOE_THROTTLE_ANON`` | API calls per anonymous address | 60/minute |
| ``ODMOE_THROTTLE_CHAT`` | chat messages per user | 20/minute |
| ``ODMOE_MAX_ACTIVE_JOB_PROMPTS_PER_USER`` | prompts a user's jobs may have queued or running (429) | 200 |
| ``ODMOE_METRICS_TOKEN`` | the bearer token Prometheus scrapes ``/metrics`` with (production: the only way in) | none |
| ``ODMOE_MAX_STORED_JOB_BYTES_PER_USER`` | bytes a user's jobs may store: prompts, answers, metrics (413) | 268435456 |

``deploy/odmoe.env.example`` lists them all for a production host.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

REPO_DIR = Path(__file__).resolve().parents[4]
VAR_DIR = Path(os.environ.get("ODMOE_VAR_DIR", REPO_DIR / "var"))
# Empty: ``VAR_DIR / "models"`` (decided where it is used, so a test that moves VAR_DIR moves it too).
MODELS_DIR = os.environ.get("ODMOE_MODELS_DIR", "")

# Once the default here, so published with the source: production refuses it by name, since an
# install set up before it was dropped may still carry it in its environment.
INSECURE_DEV_SECRET = "odmoe-insecure-development-key-change-me"
# No fallback: an empty key makes Django refuse to sign anything. Each purpose's settings say
# where the key comes from (local: this install's own file; test: the suite's; production: the
# environment, checked).
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "")
# Earlier keys, still accepted for what they signed (sessions, reset links), never used to sign:
# a key is rotated without logging everyone out (docs/production.md).
SECRET_KEY_FALLBACKS = [k for k in os.environ.get("DJANGO_SECRET_KEY_FALLBACKS", "").split(",") if k]
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "controlplane.accounts",
    "controlplane.nodes",
    "controlplane.artifacts",
    "controlplane.deployments",
    "controlplane.ops",
    "controlplane.serving",
    "controlplane.chat",
    "controlplane.console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # it turns a locked-out login into its 429 page
    "controlplane.database_away.DatabaseAwayMiddleware",  # last: a view's database error is a 503
]

# Login lockout (django-axes): 5 failed logins for one username from one address lock that
# pair out for 15 minutes, and 20 for one username from any addresses lock that username out
# everywhere (a guesser spread over many addresses); a success resets its own address's count.
# Counted in the database, so every server process sees the same (controlplane/accounts/lockout.py).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_HANDLER = "controlplane.accounts.lockout.LockoutHandler"
AXES_FAILURE_LIMIT = int(os.environ.get("ODMOE_LOGIN_FAILURE_LIMIT", "5"))
LOGIN_USERNAME_FAILURE_LIMIT = int(os.environ.get("ODMOE_LOGIN_USER_FAILURE_LIMIT", "20"))
AXES_COOLOFF_TIME = float(os.environ.get("ODMOE_LOGIN_LOCKOUT_HOURS", "0.25"))
# The pair first: a success resets only that (controlplane.accounts.lockout).
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"], "username"]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False

ROOT_URLCONF = "controlplane.config.urls"
WSGI_APPLICATION = "controlplane.config.wsgi.application"
ASGI_APPLICATION = "controlplane.config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_DIR / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# SQLite serves several processes here (ASGI server, Celery, ``manage.py``): write-ahead
# logging lets readers and a writer overlap, and transactions that take the write lock at
# their start wait their turn instead of failing with "database is locked" mid-way.
SQLITE_OPTIONS = {
    "timeout": 30,
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}
# Seconds a server connection is kept for the next request or task. 0 by default, as Django
# says for ASGI: each request's synchronous code runs on a thread of its own, so a kept
# connection is never reused and only piles up (400 requests, 16 at a time, left 65 idle
# PostgreSQL connections behind one uvicorn at 60 s, none at 0). Health checks make a kept
# connection that the server dropped (a restart) a new one, not a failed request.
DB_CONN_MAX_AGE = int(os.environ.get("ODMOE_DB_CONN_MAX_AGE", "0"))


def database_from_url(url: str) -> dict:
    """The ``DATABASES`` entry for ``url``, with what each engine needs here."""
    database = dj_database_url.parse(url, conn_max_age=DB_CONN_MAX_AGE, conn_health_checks=True)
    if database["ENGINE"] == "django.db.backends.sqlite3":
        database["OPTIONS"] = {**SQLITE_OPTIONS, **database.get("OPTIONS", {})}
        database["CONN_MAX_AGE"] = 0  # a file: opening it costs nothing to keep
    return database


DATABASES = {"default": database_from_url(os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Django's full set: not like the account's own name or e-mail, 8 characters or more, not one of
# the 20,000 most common passwords, not all digits.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATICFILES_DIRS = [REPO_DIR / "frontend" / "static"]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

REST_FRAMEWORK = {
    # API keys first: a bad key is then a 401 with "WWW-Authenticate: Bearer", not a 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    # DRF's defaults, with JSON nested too deeply for Python's parser a 400 (controlplane/parsers.py).
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    # Clients are told apart by the connection's address, never by an X-Forwarded-For header
    # anyone can write; behind N reverse proxies that set it, ODMOE_NUM_PROXIES=N.
    "NUM_PROXIES": int(os.environ.get("ODMOE_NUM_PROXIES", "0")),
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.Pages",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # Per user (API key or session) and per address for anonymous calls; agents, which
    # authenticate as nodes, are not counted (controlplane/throttles.py).
    "DEFAULT_THROTTLE_CLASSES": ["controlplane.throttles.UserThrottle", "controlplane.throttles.AnonThrottle"],
    # DRF runs the throttles after the credential and permission checks: calls refused there (a
    # made-up key, none, a permission lacking) are counted here instead (anonymous, by address).
    "EXCEPTION_HANDLER": "controlplane.throttles.exception_handler",
    "DEFAULT_THROTTLE_RATES": {
        "user": os.environ.get("ODMOE_THROTTLE_USER", "600/minute"),
        "anon": os.environ.get("ODMOE_THROTTLE_ANON", "60/minute"),
        # Messages one user sends the chat (each one a generation); past it, the message is refused.
        "chat": os.environ.get("ODMOE_THROTTLE_CHAT", "20/minute"),
    },
}
# The largest request body (and websocket frame) the server reads, checked before any view
# (controlplane/edge.py; past it: 413, or a socket closed with 1009). 16 MiB: the largest
# request that has a use is a job of 100 prompts (serving.bounds.JOB_PROMPTS) that each fill a
# 32k-token context (Mixtral's) at about 4 bytes a token, some 13 MB; it is also uvicorn's own
# default for a websocket frame. Django's cap on a body it reads into memory is the same, so
# the two never disagree about a request.
MAX_REQUEST_BYTES = int(os.environ.get("ODMOE_MAX_REQUEST_BYTES", str(16 * 2**20)))
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
# Prompts one user's jobs may have queued or running at once (serving/jobs.py; past it, 429):
# jobs run from one queue in the order they came, so a user's many prompts hold everyone
# else's behind them. 200: two jobs of the most prompts one job takes (100).
MAX_ACTIVE_JOB_PROMPTS_PER_USER = int(os.environ.get("ODMOE_MAX_ACTIVE_JOB_PROMPTS_PER_USER", "200"))
# Prometheus scrapes /metrics with ``Authorization: Bearer`` this token (serving/metrics.py). Here
# a staff user's key with the ``metrics`` scope, or a staff session, also does; production takes
# the token alone (METRICS_TOKEN_ONLY), and serves /metrics to nobody without one.
METRICS_TOKEN = os.environ.get("ODMOE_METRICS_TOKEN", "")
METRICS_TOKEN_ONLY = False

# Bytes one user's jobs may store: their prompts, answers (text and token ids) and metrics summaries
# (serving/jobs.py; a submit past it is a 413 until ended jobs are deleted). Every job is kept until
# its owner deletes it, so without a bound the database grows with every job. 256 MiB: the largest
# job (100 prompts that fill a 32k-token context, the body cap's reason, and their 4,096-token
# answers) stores about 20 MB, so a dozen of those, or some 40,000 outputs of a 1 KB prompt and a
# 256-token answer (about 6 KB each); a hundred users then hold at most 25 GiB.
MAX_STORED_JOB_BYTES_PER_USER = int(os.environ.get("ODMOE_MAX_STORED_JOB_BYTES_PER_USER", str(256 * 2**20)))

SPECTACULAR_SETTINGS = {
    "TITLE": "odmoe control plane API",
    "DESCRIPTION": "Enroll GPU boxes, register models, build shards and deploy them.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's files come from drf-spectacular-sidecar: the docs page works offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # Several models have a "status": name each choice set after its model.
    "ENUM_NAME_OVERRIDES": {
        "NodeStatusEnum": "controlplane.nodes.models.NodeStatus",
        "DeploymentStatusEnum": "controlplane.deployments.models.DeploymentStatus",
        "MemberStateEnum": "controlplane.deployments.models.MemberState",
        "ShardStatusEnum": "controlplane.artifacts.models.ShardStatus",
        "TaskStateEnum": "controlplane.nodes.models.TaskState",
        "JobStatusEnum": "controlplane.serving.models.JobStatus",
        "JobOutputStatusEnum": "controlplane.serving.models.OutputStatus",
        # The deployment's expert_codec, the shard set's and the shard build's: one choice set.
        "ExpertCodecEnum": "inference.constants.EXPERT_CODECS",
    },
}

JOIN_TOKEN_TTL_S = int(os.environ.get("ODMOE_JOIN_TOKEN_TTL_S", "86400"))
# The certificate boxes pin (controlplane/nodes/tls.py); empty: no pin.
TLS_CERT_FILE = os.environ.get("ODMOE_TLS_CERT_FILE", "")

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_ACKS_LATE = True  # a task survives a worker that dies mid-way: it runs again
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True  # results live in the database, not in Redis
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A task whose worker died without acknowledging it runs again after this long (Redis broker).
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": float(os.environ.get("ODMOE_TASK_REDELIVERY_S", "3600"))}

# "default" is this process's own (the production settings share it through Redis); "shared" is
# Redis everywhere, for what every process must see alike (controlplane.nodes.step_watch).
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "shared": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "odmoe",
        # A Redis that stalls without refusing costs a request a second, not its whole wait.
        "OPTIONS": {"socket_timeout": 1, "socket_connect_timeout": 1},
    },
}

# Room for a whole answer's tokens in a channel whose reader is briefly busy (the default is 100).
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "controlplane.channel_layer.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "capacity": 5000},
    }
}

NODE_HEARTBEAT_TIMEOUT_S = float(os.environ.get("ODMOE_NODE_HEARTBEAT_TIMEOUT_S", "15"))
# A chat answer whose page went away (closed, reloaded, or its web worker restarted) goes on this long
# for the page to come back and pick it up where it left off; then it is stopped (chat.writing).
CHAT_RESUME_GRACE_S = float(os.environ.get("ODMOE_CHAT_RESUME_GRACE_S", "20"))
# Chat sockets one user may hold open in one web process (``chat.pages``): each holds a file
# descriptor and, while it follows an answer, a Redis connection; past it a page is closed with 4429.
CHAT_PAGES_PER_USER = int(os.environ.get("ODMOE_CHAT_PAGES_PER_USER", "32"))
# Jobs run for minutes: they get a queue (and, under ``manage.py up``, a worker) of their own, so
# offline detection and deployment pushes never wait behind them on the default queue.
CONTROL_QUEUE = "celery"
JOBS_QUEUE = "jobs"
CELERY_TASK_DEFAULT_QUEUE = CONTROL_QUEUE
CELERY_TASK_ROUTES = {
    "controlplane.serving.tasks.recover_lost_jobs_task": {"queue": CONTROL_QUEUE},  # never behind jobs
    "controlplane.serving.tasks.*": {"queue": JOBS_QUEUE},
}
CELERY_BEAT_SCHEDULE = {
    "expire-silent-nodes": {
        "task": "controlplane.nodes.tasks.expire_silent_nodes_task",
        "schedule": max(1.0, NODE_HEARTBEAT_TIMEOUT_S / 3),
    },
    # Redis restarted without its data (a crash, no persistence): unfinished job outputs are queued again.
    "recover-lost-jobs": {"task": "controlplane.serving.tasks.recover_lost_jobs_task", "schedule": 5.0},
    # A web process killed mid-answer: its chat answers fail, saying why, instead of "being written" forever.
    "settle-interrupted-answers": {"task": "controlplane.chat.tasks.settle_interrupted_answers_task", "schedule": 15.0},
}

# Everything to stderr, where a process supervisor (systemd, ``manage.py up``) keeps it.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["stderr"], "level": os.environ.get("ODMOE_LOG_LEVEL", "INFO")},
    "loggers": {"django.request": {"handlers": ["stderr"], "level": "WARNING", "propagate": False}},
}
