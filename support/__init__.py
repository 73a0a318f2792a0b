"""What the tests and the benchmark harness share: private broker servers on free ports
(``servers``), a private Redis Cluster with or without replicas (``cluster``), a TCP fault
proxy (``faultproxy``), a launcher for ``python -m supervisor`` (``supervision``), envelopes
published as queue 5's producers do (``envelopes``), waiting for a condition in an event
loop (``waiting``), receiving from an adapter (``brokers``) and the chaos soak's workload
and ledger reader (``soak_workload``, ``soak_ledger``; the soak itself is ``bench.chaos``).
Fixtures that start servers and build brokers are in ``tests/conftest.py``. Not part of the
installed package; ``bench`` uses it without importing ``tests``."""
