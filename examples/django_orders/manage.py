#!/usr/bin/env python
"""The example shop's manage.py: ``python examples/django_orders/manage.py migrate``,
then ``runserver`` (see README.md)."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
