"""What the tests and the benchmark harness share: private broker servers on free ports
(``servers``), a TCP fault proxy (``faultproxy``) and a launcher for ``python -m supervisor``
(``supervision``). Not part of the installed package; ``bench`` uses it without importing
``tests``."""
