"""Settings of the Django test project: one PostgreSQL database, from
$SKIPJACK_DATABASE_URL (a libpq URI or key=value string), skipjack's schema from
$SKIPJACK_SCHEMA. For tests: $SHOP_CONN_MAX_AGE (seconds, or "none": persistent) and
$SHOP_CONN_HEALTH_CHECKS ("1") set the database's CONN_MAX_AGE and CONN_HEALTH_CHECKS;
$SHOP_CRON ("1") adds a cron entry of the Tasks backend that runs every minute."""

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ.get("SKIPJACK_DATABASE_URL", ""))
_max_age = os.environ.get("SHOP_CONN_MAX_AGE", "0")

SECRET_KEY = "test-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "skipjack.contrib.django",
    "shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        "CONN_MAX_AGE": None if _max_age == "none" else int(_max_age),
        "CONN_HEALTH_CHECKS": os.environ.get("SHOP_CONN_HEALTH_CHECKS") == "1",
    }
}

SKIPJACK = {"SCHEMA": os.environ.get("SKIPJACK_SCHEMA", "skipjack")}

TASKS = {
    "default": {
        "BACKEND": "skipjack.contrib.django.tasks.SkipjackBackend",
        "QUEUES": ["default", "reports"],
        "OPTIONS": {
            "tasks": {"shop.tasks.flaky_report": {"max_attempts": 2,
                                                   "backoff": {"base": 0.01, "cap": 0.01}},
                      "shop.tasks.receipt": {"idempotency_key": "receipt-{order_id}"}},
            "cron": [{"task": "shop.tasks.add", "schedule": "* * * * *", "args": [2, 3],
                      "name": "shop-add-every-minute"}] if os.environ.get("SHOP_CRON") else [],
        },
    },
}
