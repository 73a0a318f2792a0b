"""Chaos soak: usage totals stay exact while processes, connections and brokers fail.

    python -m bench.chaos --broker redis|nats|both --messages N --seconds S --seed K

See ``bench.chaos.run`` for what is published, which faults are injected and what is
checked at the end. ``bench.chaos.handler`` is the job's handler (it wraps the stats-usage
example); this package's ``__init__`` stays empty so the supervisor imports little with it.
"""
