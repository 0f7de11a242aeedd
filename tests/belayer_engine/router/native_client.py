"""A tiny client of SGLang's native HTTP API (stdlib only), shared by the native-API tests."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit


def call(base: str, method: str, path: str, body=None, headers=None, timeout: float = 300):
    """(status, parsed JSON or text) of one request."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text
    finally:
        conn.close()


def generate(base: str, body: dict, headers=None, timeout: float = 300):
    """``/generate``: (status, the response) or, streamed, (status, [chunks]) with the
    ``[DONE]`` marker checked."""
    if not body.get("stream"):
        return call(base, "POST", "/generate", body, headers, timeout)
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/generate", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, json.loads(resp.read().decode())
        chunks, done = [], False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
        assert done, f"stream ended without data: [DONE] after {len(chunks)} chunks"
        return resp.status, chunks
    finally:
        conn.close()
