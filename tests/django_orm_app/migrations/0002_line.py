import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_orm_app", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="Line",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "order",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, to="django_orm_app.order"
                    ),
                ),
            ],
        ),
    ]
