"""The asyncio shell: the same rules as the sync API (``latchkey._core``), driven by awaiting.

Public names come from :mod:`latchkey` (``connect_async``, ``AsyncStore``, ``AsyncLock``…).
"""
