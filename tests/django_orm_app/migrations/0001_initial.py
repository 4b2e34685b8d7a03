from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []

    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("cart_mandate_id", models.CharField(max_length=100, unique=True)),
                ("user_id", models.CharField(max_length=100)),
                ("total", models.IntegerField()),
            ],
        ),
    ]
