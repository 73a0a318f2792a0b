"""A broker URL whose password holds an unencoded ``#``, ``?`` or ``/`` (issue 28, L1): the
error says what is wrong and how to fix it, and quotes no piece of the secret (urllib's own
message did: "Port could not be cast to integer value as 'S3c'")."""

from __future__ import annotations

import pytest

from supervisor.config import ConfigError, loads

JOB = '[job]\nqueue = "q"\nhandler = "examples.noop:handle"\n'
#: The secret is split by the character under test; neither half may be shown.
BEFORE, AFTER = "S3c", "ret9"


def urls(character: str) -> list[str]:
    secret = f"{BEFORE}{character}{AFTER}"
    return [
        f"redis://user:{secret}@127.0.0.1:6379/0",  # the parser reads "S3c" as the port
        f":{secret}@127.0.0.1:6379/0".join(["redis://", ""]),  # password only
        f"redis://user:4{character}{AFTER}@127.0.0.1/0",  # a port that parses: "4"
        f"nats://{secret}@127.0.0.1:4222",  # a token: the host would be "S3c"
        f"tls://user:{secret}@127.0.0.1:4222",
    ]


def error_of(url: str, from_environment: bool) -> str:
    if from_environment:
        text, environ = JOB, {"QUEUE_BROKER_URL": url}
    else:
        text, environ = f'[broker]\nurl = "{url}"\n{JOB}', {}
    with pytest.raises(ConfigError) as raised:
        loads(text, environ=environ, import_handler=False)
    return str(raised.value)


@pytest.mark.parametrize("from_environment", [False, True], ids=["file", "environment"])
@pytest.mark.parametrize("character", ["#", "?", "/"])
def test_an_unencoded_character_in_a_password_is_explained_without_the_password(
        character, from_environment):
    for url in urls(character):
        message = error_of(url, from_environment)
        assert BEFORE not in message and AFTER not in message, (url, message)
        assert "percent-encoded" in message and "%23" in message and "%3F" in message, message
        assert "%2F" in message, message


def test_an_at_sign_inside_a_query_value_is_no_cut_password():
    text = f'[broker]\nurl = "redis://127.0.0.1:6379/0?password=p@ss"\n{JOB}'
    assert loads(text, import_handler=False).broker.url.endswith("password=p@ss")
