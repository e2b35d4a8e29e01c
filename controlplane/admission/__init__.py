"""Admission's asyncio shell: ``service`` (the parking lot, its wakes and the replication of the core's ledger to the
shared store), ``quota`` (tenants' budgets through the rate limiter) and ``watch`` (the decision stream the admin API
serves). The decisions themselves are the pure core's (``controlplane/core/admission.py``)."""
