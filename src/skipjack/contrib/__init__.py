"""Integrations with frameworks, each an optional extra: :mod:`skipjack.contrib.django`
(``skipjack[django]``), :mod:`skipjack.contrib.sqlalchemy` (``skipjack[sqlalchemy]``) and
:mod:`skipjack.contrib.starlette` (FastAPI and Starlette: a worker in the app's lifespan)."""
