"""Settings of the test project: the databases and latchkey settings come from the
environment the test sets (JSON), so one project serves PostgreSQL and SQLite."""

import json
import os

SECRET_KEY = "latchkey-tests-only"  # a throwaway test project
INSTALLED_APPS = ["latchkey.contrib.django", "lockapp"]
DATABASES = json.loads(os.environ["TEST_DATABASES"])
if "TEST_LATCHKEY" in os.environ:
    LATCHKEY = json.loads(os.environ["TEST_LATCHKEY"])
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
TEST_RUNNER = "latchkey.contrib.django.testing.DiscoverRunner"
