"""Admission's asyncio shell: ``service`` (the parking lot and its wakes), ``replication`` (the store calls that keep the
core's ledger and the shared store together) around ``mirror`` (their rules, sans I/O), ``quota`` (tenants' budgets
through the rate limiter) and ``watch`` (the decision stream the admin API serves). The decisions themselves are the pure
core's (``controlplane/core/admission.py``)."""
