from django.db import models


class Order(models.Model):
    note = models.TextField(default="")
    paid = models.BooleanField(default=False)


class Effect(models.Model):
    """One row per committed effect of a job; no unique key, so that a duplicate would
    show."""

    job_id = models.BigIntegerField()
    pid = models.IntegerField()
