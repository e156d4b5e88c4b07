"""Framework integrations, each an optional extra and imported only by its users:

- :mod:`latchkey.contrib.fastapi` (``pip install 'latchkey[fastapi]'``): the store opened and
  closed with the app, and a dependency that holds a lock for one request;
- :mod:`latchkey.contrib.celery` (``latchkey[celery]``): a task that runs at most once at a
  time per argument set;
- :mod:`latchkey.contrib.django` (``latchkey[django]``): the store from settings or a
  ``DATABASES`` alias, system checks, and ``manage.py latchkey``.

.. versionadded:: 0.2
"""
