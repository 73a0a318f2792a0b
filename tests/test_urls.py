"""``broker.urls.redact``: every credential form a broker URL can carry is hidden."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from broker.urls import redact

SECRET = "Zx9-s3cret"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://default:{SECRET}@h:6379/0", "redis://default:***@h:6379/0"),
        (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
        (f"redis://:{SECRET}@Hq7-pw@h:6379/0", "redis://:***@h:6379/0"),  # unencoded @
        (f"redis://u:{SECRET}%40Hq7-pw@h:6379/0", "redis://u:***@h:6379/0"),
        (f"redis://h:6379/0?password={SECRET}", "redis://h:6379/0?password=***"),
        (f"redis://h/0?db=1&pass={SECRET}&x=2", "redis://h/0?db=1&pass=***&x=2"),
        (f"redis://h/0?Token={SECRET}", "redis://h/0?Token=***"),
        (f"redis://h/0?auth={SECRET}#frag", "redis://h/0?auth=***#frag"),
        (f"rediss://u:{SECRET}@h:6380/2?ssl_cert_reqs=none",
         "rediss://u:***@h:6380/2?ssl_cert_reqs=none"),
        (f"nats://{SECRET}@h:4222", "nats://***@h:4222"),  # token-only userinfo
        (f"tls://alice:{SECRET}@h:4222", "tls://alice:***@h:4222"),
        (f"tls://{SECRET}@h:4222", "tls://***@h:4222"),
        (f"nats://a:{SECRET}@h1:4222,nats://b:{SECRET}@h2:4222",
         "nats://a:***@h1:4222,nats://b:***@h2:4222"),
        (f"redis://:pa ss{SECRET}@h/0", "redis://:***@h/0"),  # a space in the password
        (f"redis://:pa/ss{SECRET}@h/0", "redis://:***@h/0"),  # ... or a slash
        (f"redis://:pa?ss{SECRET}@h/0", "redis://:***@h/0"),  # ... or a question mark
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("nats://h:4222", "nats://h:4222"),
        ("redis://h/0?db=1&client_name=x", "redis://h/0?db=1&client_name=x"),
    ],
)
def test_a_url_keeps_no_credential(url, shown):
    assert redact(url) == shown
    assert SECRET not in redact(url)
    assert redact(redact(url)) == redact(url)  # applying it twice changes nothing more


def test_the_userinfo_ends_where_the_url_parser_ends_it():
    url = f"redis://:{SECRET}@Hq7-pw@host:6379/0"
    assert urlsplit(url).password == f"{SECRET}@Hq7-pw"  # what redis-py would send
    assert "Hq7-pw" not in redact(url) and urlsplit(redact(url)).hostname == "host"


def test_urls_inside_text_are_redacted_and_the_rest_is_kept():
    text = (f"cannot reach redis://:{SECRET}@h:1/0: refused; also 'nats://{SECRET}@n:4222' "
            f"and redis://h/0?password={SECRET} for user@example.com")
    assert redact(text) == ("cannot reach redis://:***@h:1/0: refused; also 'nats://***@n:4222' "
                            "and redis://h/0?password=*** for user@example.com")


def test_redacting_a_message_again_keeps_its_punctuation():
    message = f"cannot reach Redis at {redact(f'redis://h/0?password={SECRET}')}: refused"
    assert redact(message) == message == "cannot reach Redis at redis://h/0?password=***: refused"


def test_text_without_a_url_is_unchanged():
    for text in ("", "plain words", "user@example.com", "a:b@c", "utopia-queue"):
        assert redact(text) == text
