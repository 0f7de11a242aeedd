"""The engine's worker secret: safe as a command-line option's value and as a bearer token."""

from __future__ import annotations

import string

from belayer_engine.common import worker_auth


def test_secrets_never_look_like_an_option_and_are_header_safe():
    # SGLang reads --api-key through argparse: a value starting with "-" is taken for an option
    drawn = [worker_auth.new_secret() for _ in range(2000)]
    assert all(set(s) <= set(string.hexdigits.lower()) and len(s) == 64 for s in drawn)
    assert len(set(drawn)) == len(drawn)


def test_authorized_takes_only_the_bearer_of_the_secret():
    secret = worker_auth.new_secret()
    assert worker_auth.authorized(worker_auth.headers(secret)["Authorization"], secret)
    assert not worker_auth.authorized(f"Bearer {worker_auth.new_secret()}", secret)
    assert not worker_auth.authorized(None, secret)
    assert worker_auth.authorized(None, None)
