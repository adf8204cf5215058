"""Integrations with frameworks, each an optional extra: ``skipjack.contrib.django``
(``skipjack[django]``), ``skipjack.contrib.sqlalchemy`` (``skipjack[sqlalchemy]``) and
``skipjack.contrib.starlette`` (FastAPI and Starlette: a worker in the app's lifespan)."""
