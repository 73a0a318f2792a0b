"""Subjects of the JetStream API, in one place.

The broker, its setup and the benches all speak to JetStream with plain
requests on ``$JS.API.<verb>.<stream>[.<consumer>]`` (nats-py's ``js`` helpers are not used
on the hot path); building each subject here keeps one spelling of each. This module
imports nothing of the project.
"""

from __future__ import annotations

API = "$JS.API"


def stream_info(stream: str) -> str:
    return f"{API}.STREAM.INFO.{stream}"


def stream_create(stream: str) -> str:
    return f"{API}.STREAM.CREATE.{stream}"


def stream_delete(stream: str) -> str:
    return f"{API}.STREAM.DELETE.{stream}"


def stream_msg_get(stream: str) -> str:
    return f"{API}.STREAM.MSG.GET.{stream}"


def stream_msg_delete(stream: str) -> str:
    return f"{API}.STREAM.MSG.DELETE.{stream}"


def consumer_info(stream: str, consumer: str) -> str:
    return f"{API}.CONSUMER.INFO.{stream}.{consumer}"


def consumer_create(stream: str, consumer: str) -> str:
    return f"{API}.CONSUMER.CREATE.{stream}.{consumer}"


def consumer_pause(stream: str, consumer: str) -> str:
    return f"{API}.CONSUMER.PAUSE.{stream}.{consumer}"


def consumer_next(stream: str, consumer: str) -> str:
    """Where pull requests for the consumer go."""
    return f"{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def max_deliveries_advisory(stream: str) -> str:
    """Where the server announces deliveries of any consumer of ``stream`` that ran out of
    MaxDeliver."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*"
