"""Reading an HTTP request body as one JSON object (torch-free): the router's OpenAI routes
and the reference worker's ``/generate`` both refuse anything else with a ``UsageError``
(bad UTF-8, bad JSON, nesting deep enough to blow the parser's stack, a non-object)."""

from __future__ import annotations

import json

from belayer_core.errors import UsageError


def parse_json_object(raw: bytes, not_object: str = "request body must be a JSON object") -> dict:
    """``raw`` as a JSON object; ``not_object`` is the error text for valid JSON of another kind."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise UsageError("body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise UsageError(not_object)
    return body
