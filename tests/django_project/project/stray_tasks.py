"""A task module in the project package, outside every installed app: a worker of manage.py
skipjack never imports it (declaring its task after Django's setup warns)."""

from skipjack.contrib.django import app


@app.task(name="project.stray")
def stray() -> str:
    return "ran in this process"
