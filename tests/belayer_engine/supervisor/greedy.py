"""What a slot's own worker answers (greedy ids and weight version), bypassing the router."""

from __future__ import annotations

import json
import urllib.request

from belayer_engine.engine import RecoverableEngine

PROMPTS = ["The rope holds", "Belayer keeps the climber"]


def direct(eng: RecoverableEngine, slot: int, prompt: str) -> tuple[list[int], int]:
    """Greedy ids and weight version from slot ``slot``'s worker itself (not the router)."""
    url = eng.status()["slots"][f"w{slot}"]["worker_url"]
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **eng.worker_headers()})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    return list(out["output_ids"]), int(out["meta_info"]["weight_version"])


def answers(eng: RecoverableEngine, slot: int) -> dict[str, list[int]]:
    return {p: direct(eng, slot, p)[0] for p in PROMPTS}


def assert_serves(eng: RecoverableEngine, slots: tuple[int, ...], expected: dict[str, list[int]], version: int) -> None:
    """Every slot's worker answers ``expected`` (greedy ids) at weight ``version``, and its arena holds that version."""
    from belayer_engine.arena.client import ArenaClient

    for slot in slots:
        assert answers(eng, slot) == expected, f"slot {slot} serves other weights"
        assert direct(eng, slot, PROMPTS[0])[1] == version, f"slot {slot}'s worker reports another version"
        assert ArenaClient(eng.arena_socket(slot)).describe()["version"] == version, f"slot {slot}'s arena"
