"""The jobs table as an unmanaged model (for the admin): this migration creates nothing;
skipjack's own migrations, applied after ``manage.py migrate``, make the table."""

from django.db import migrations, models

from ..models import job_table


class Migration(migrations.Migration):

    initial = True

    dependencies = [
    ]

    operations = [
        migrations.CreateModel(
            name='Job',
            fields=[
                ('id', models.BigIntegerField(primary_key=True, serialize=False)),
                ('queue', models.TextField()),
                ('task', models.TextField()),
                ('args', models.JSONField()),
                ('state', models.TextField(choices=[('scheduled', 'scheduled'), ('available', 'available'), ('running', 'running'), ('succeeded', 'succeeded'), ('discarded', 'discarded'), ('cancelled', 'cancelled')])),
                ('attempt', models.IntegerField()),
                ('max_attempts', models.IntegerField()),
                ('priority', models.SmallIntegerField()),
                ('run_at', models.DateTimeField()),
                ('created_at', models.DateTimeField()),
                ('attempted_at', models.DateTimeField(null=True)),
                ('finished_at', models.DateTimeField(null=True)),
                ('worker', models.TextField(null=True)),
                ('idempotency_key', models.TextField(null=True)),
                ('errors', models.JSONField()),
                ('result', models.JSONField(null=True)),
                ('progress', models.JSONField(null=True)),
                ('metadata', models.JSONField(null=True)),
            ],
            options={
                'verbose_name': 'job',
                'db_table': job_table(),  # the schema of settings.SKIPJACK
                'ordering': ('-id',),
                'managed': False,
            },
        ),
    ]
