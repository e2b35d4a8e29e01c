"""The rig that the tests and the benchmarks share to drive sluice as a user would: a control plane on a thread of its
own (``threaded``), ``sluice up`` as a subprocess (``upprocess``), a real llama.cpp server (``llama``), free ports and
waits (``waits``). Not part of the product: it is not installed with it, and no product module imports it (a test
checks)."""
