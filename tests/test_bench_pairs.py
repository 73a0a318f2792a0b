"""bench.pairs: rows of the two runs matched by what they measured, one ratio each, medians."""

from bench.pairs import pair, summary


def row(broker: str, prefetch: int, rate: float) -> dict[str, object]:
    return {"system": "queue-supervisor", "broker": broker, "handler": "noop",
            "prefetch": prefetch, "coroutines": 1, "jobs_per_s": rate,
            "client_us_per_job": 10.0}


def test_rows_are_matched_by_broker_handler_prefetch_and_processes() -> None:
    before = [row("redis", 100, 50_000.0), row("nats", 100, 20_000.0), row("redis", 1, 900.0)]
    after = [row("nats", 100, 22_000.0), row("redis", 100, 45_000.0)]  # no prefetch 1 row
    entries = pair(3, before, after, ("aaa", "bbb"))
    assert [(e["broker"], e["prefetch"], round(e["ratio"], 3)) for e in entries] == [
        ("redis", 100, 0.9), ("nats", 100, 1.1)]
    assert entries[0]["pair"] == 3 and entries[0]["before"] == "aaa"
    assert entries[0]["before_client_us_per_job"] == 10.0


def test_the_summary_gives_every_ratio_and_their_median() -> None:
    entries = []
    for number, (old, new) in enumerate([(100.0, 90.0), (100.0, 110.0), (100.0, 99.0)], 1):
        entries += pair(number, [row("redis", 100, old)], [row("redis", 100, new)], ("a", "b"))
    (only,) = summary(entries)
    assert only["ratios"] == [0.9, 1.1, 0.99]
    assert only["median"] == 0.99
