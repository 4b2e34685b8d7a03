"""The records table: the native store's own migration, run on the database migrated.

SQLite gets the SQLite store's tables and ``PRAGMA user_version``, PostgreSQL the
PostgreSQL store's table and its schema version table, MySQL and MariaDB the MySQL
store's InnoDB tables and theirs, exactly as ``retrysafe migrate --store …`` would
create them, so the native statements and the CLI work on them. Another database
vendor stops ``migrate`` with an error (keep it out with a database router's
``allow_migrate``). Not atomic: the native migration is its own transaction (MySQL
commits each DDL statement by itself). Reversing it keeps the records (drop the
tables by hand).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def create_records(apps: Any, schema_editor: Any) -> None:
    """The native store's migration on the schema editor's connection."""
    from retrysafe.stores.django import DjangoStore

    connection = schema_editor.connection
    store = DjangoStore(connection.alias)
    try:
        store.migrate_on(connection)
    finally:
        store.close()


class Migration(migrations.Migration):  # type: ignore[misc]  # (Django ships no types)
    initial = True
    atomic = False
    dependencies: list[Any] = []

    operations = [
        migrations.RunPython(create_records, migrations.RunPython.noop, elidable=False),
        migrations.CreateModel(
            name="Record",
            fields=[
                ("key_hash", models.BinaryField(primary_key=True, serialize=False)),
                ("operation", models.TextField()),
                ("status", models.SmallIntegerField()),
                ("attempts", models.IntegerField()),
                ("created_at", models.FloatField()),
                ("updated_at", models.FloatField()),
                ("completed_at", models.FloatField(null=True)),
                ("lease_until", models.FloatField()),
                ("expires_at", models.FloatField()),
                ("response_status", models.IntegerField(null=True)),
            ],
            options={
                "db_table": "retrysafe_records",
                "ordering": ("-created_at",),
                "managed": False,
            },
        ),
    ]
