"""What the tests and the benchmark harness share: private broker servers on free ports
(``servers``), a private Redis Cluster with or without replicas (``cluster``), a TCP fault
proxy (``faultproxy``) and a launcher for ``python -m supervisor`` (``supervision``). Not
part of the installed package; ``bench`` uses it without importing ``tests``."""
