"""SGLang's weight routes on the engine's router, attacked as in issue 47 (items 1-3, 8).

Real processes: an engine (arena, worker, shadow) behind an API key, in this process (so
this process's memory is the engine's). ``/update_weights_from_tensor`` takes tensors by
value (safetensors bytes, checked against the served layout before any tensor byte is
decoded); a pickle of shared-memory handles (SGLang's ``MultiprocessingSerializer``) is
refused whole, before anything in it is unpickled: it can no longer open, grow or write a
/dev/shm file (the arena's live weights included), connect to a socket it names, or make
the engine materialise a view it describes. ``update_weights_from_disk`` answers 400 for
a checkpoint file that is not one, and a ``weight_version`` that is not a plain number.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import socket
import threading
from pathlib import Path

import pytest

from belayer_engine import RecoverableEngine
from belayer_engine.router import RouterConfig

from ..conftest import poll
from .native_client import call, generate
from .test_native_api import PROMPT, base
from .weight_probes import named_handle, shared_file

pytestmark = pytest.mark.timeout(600)

KEY = "weights-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HANDOVER_EVENTS = {"detected", "fenced", "handover", "excluded", "cold_restart", "arena_lost"}


@pytest.fixture(scope="module")
def engine():
    with RecoverableEngine.launch(workers=1, shadow=True, router=RouterConfig(api_key=KEY)) as eng:
        eng.wait_ready(timeout=180)
        yield eng


def greedy_ids(engine) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    status, out = generate(base(engine), body, AUTH)
    assert status == 200, out
    return out["output_ids"]


def head_name(engine) -> tuple[str, list[int]]:
    layout, _ = engine.call(engine.supervisor.weight_layout())
    name = "lm_head.weight" if "lm_head.weight" in layout else "model.embed_tokens.weight"
    return name, layout[name]


def by_value(tensors: dict) -> str:
    """What a trainer sends: the tensors' bytes, as safetensors, base64."""
    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode()


def post_tensor(engine, entries, **extra) -> tuple[int, dict]:
    return call(base(engine), "POST", "/update_weights_from_tensor", {"serialized_named_tensors": entries, **extra},
                AUTH)


def version(engine) -> str:
    return call(base(engine), "GET", "/model_info", headers=AUTH)[1]["weight_version"]


def arena_files(engine) -> list[Path]:
    """The arena's weight files (found from this host, as a local user with access would)."""
    from belayer_engine.arena.shm_files import SHM_DIR, SHM_PREFIX

    pid = engine.status()["slots"]["w0"]["arena_pid"]
    files = sorted(p for p in SHM_DIR.glob(f"{SHM_PREFIX}{pid}-*") if p.name.endswith(("-w0", "-w1")))
    assert len(files) == 2, files
    return files


def digest(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns


def vm(pid: int | str, key: str) -> int:
    """``key`` (VmHWM, VmRSS) of ``pid`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


def assert_refused_pickle(status: int, out: dict) -> None:
    assert status == 400 and not out["success"], out
    assert "pickle" in out["message"] and "safetensors" in out["message"], out  # names what to send instead


def test_tensors_by_value_become_one_engine_wide_version(engine):
    import torch

    before = greedy_ids(engine)
    name, shape = head_name(engine)
    head = torch.randn(shape, generator=torch.Generator().manual_seed(11))  # every argmax moves
    status, out = post_tensor(engine, [by_value({name: head})], weight_version="19", flush_cache=True)
    assert status == 200 and out["success"], out
    assert version(engine) == "19"
    after = greedy_ids(engine)
    assert after != before
    # checked against the served layout before anything is applied: each a 400 naming the problem
    for entries, words in [
        ([by_value({name: head[:1]})], "shape"),
        ([by_value({name: head.double()})], "dtype"),
        ([by_value({"model.no_such.weight": head})], "unknown weight"),
        ([by_value({name: head})[:-8]], "bytes"),
        (["not base64!"], "base64"),
        ([by_value({name: head}), by_value({name: head.flip(0)})], "entries differ"),  # one update for every rank
        ("x", "list"),
    ]:
        status, out = post_tensor(engine, entries)
        assert status == 400 and words in out["message"] and not out["success"], (words, out)
    assert greedy_ids(engine) == after and version(engine) == "19"
    # SGLang's tp form: one entry per rank, all the same full tensors -> one update
    status, out = post_tensor(engine, [by_value({name: head.flip(0)})] * 2, weight_version="20")
    assert status == 200 and out["success"] and version(engine) == "20", out
    assert greedy_ids(engine) != after


def test_sglangs_pickles_are_refused_unread(engine):
    """SGLang's MultiprocessingSerializer output (shared-memory handles) and any other pickle:
    400 naming the by-value form; nothing in them is called."""
    import torch

    name, shape = head_name(engine)
    before = greedy_ids(engine)
    marker = Path(f"/tmp/belayer-probe-{secrets.token_hex(4)}")

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump([(name, torch.zeros(shape))])  # what SGLang's serializer writes
    for raw in (buf.getvalue(), pickle.dumps(RunsCode())):
        status, out = post_tensor(engine, [base64.b64encode(raw).decode()])
        assert_refused_pickle(status, out)
    status, out = post_tensor(engine, [by_value({name: torch.zeros(shape)})], load_format="flattened_bucket")
    assert status == 400 and "load_format" in out["message"], out
    assert not marker.exists()
    assert greedy_ids(engine) == before


def test_a_handle_naming_a_root_only_shm_file_never_opens_it(engine):
    """Issue 47, item 1: the request used to open the file read-write, change its first bytes
    and grow it from 4 KiB to 256 MiB."""
    name, shape = head_name(engine)
    victim = Path("/dev/shm") / f"belayer-probe-{secrets.token_hex(8)}"
    victim.write_bytes(secrets.token_bytes(4096))
    victim.chmod(0o600)
    try:
        before = digest(victim)
        numel = shape[0] * shape[1]
        payload = named_handle(name, shared_file()[0], b"/" + victim.name.encode(), 256 << 20, tuple(shape),
                               (shape[1], 1))
        status, out = post_tensor(engine, [payload])
        assert_refused_pickle(status, out)
        assert digest(victim) == before and numel * 4 <= 256 << 20
    finally:
        victim.unlink()


def test_a_handle_naming_the_arenas_live_weights_changes_nothing(engine):
    """Issue 47, item 1: named after the arena's pid and start time, each request used to
    change the served weights' bytes with no version change."""
    name, shape = head_name(engine)
    ids, served = greedy_ids(engine), version(engine)
    files = arena_files(engine)
    sums = {p: digest(p) for p in files}
    checksums = engine.call(_arena_checksums(engine))
    manager = shared_file()[0]
    for p in files:
        payload = named_handle(name, manager, b"/" + p.name.encode(), p.stat().st_size, tuple(shape), (shape[1], 1))
        assert_refused_pickle(*post_tensor(engine, [payload]))
    assert {p: digest(p) for p in files} == sums
    assert engine.call(_arena_checksums(engine)) == checksums
    assert greedy_ids(engine) == ids and version(engine) == served


async def _arena_checksums(engine) -> dict:
    import asyncio

    from belayer_engine.arena.client import ArenaClient

    client = ArenaClient(str(engine.supervisor.slots[0].socket))
    sums = await asyncio.to_thread(client.checksums)
    return {k: v for k, v in sums.items() if k in ("w0", "w1")}


def test_a_handle_naming_a_silent_socket_is_refused_without_touching_it(engine, tmp_path):
    """Issue 47, item 2: a manager socket that never answers (docker.sock) held the engine ~1 s
    per request; /health went from 1.8 ms to 0.95 s p50. Now: 400 (429 beyond the updates that
    may wait), the socket never connected to, /health answered while the bad requests are sent."""
    name, shape = head_name(engine)
    path = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)  # never accepts: a connect succeeds, then nothing is ever answered
    payload = named_handle(name, str(path).encode(), b"/belayer-probe-none", 4096, (1024,), (1,))
    answers: list = []

    def bad():
        answers.append(post_tensor(engine, [payload]))

    threads = [threading.Thread(target=bad) for _ in range(8)]
    for t in threads:
        t.start()
    healthy = [call(base(engine), "GET", "/health")[0] for _ in range(8)]
    for t in threads:
        t.join(120)
    assert all(not t.is_alive() for t in threads)
    assert healthy == [200] * 8
    assert len(answers) == 8
    for status, out in answers:  # one update at a time, 4 waiting: the rest are told to come back
        if status == 429:
            assert "wait" in out["message"] and not out["success"], out
        else:
            assert_refused_pickle(status, out)
    assert sum(status == 400 for status, _ in answers) >= 5
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody ever connected
    listener.close()


def test_a_stride0_gigabyte_description_allocates_nothing(engine):
    """Issue 47, item 3: 322 bytes describing a stride-0 1 GiB tensor raised the engine's and
    the arena's peak memory by ~1.5 GiB each; the engine kept 1 GiB."""
    name, _ = head_name(engine)
    arena_pid = engine.status()["slots"]["w0"]["arena_pid"]
    manager, handle = shared_file()
    payload = named_handle(name, manager, handle, 4, (1 << 28,), (0,))  # 1 GiB of float32 over 4 bytes
    assert len(base64.b64decode(payload)) < 1024
    mine = os.getpid()
    hwm, rss, arena_hwm = vm(mine, "VmHWM"), vm(mine, "VmRSS"), vm(arena_pid, "VmHWM")
    assert_refused_pickle(*post_tensor(engine, [payload]))
    grown = {"engine peak": vm(mine, "VmHWM") - hwm, "engine rss": vm(mine, "VmRSS") - rss,
             "arena peak": vm(arena_pid, "VmHWM") - arena_hwm}
    assert max(grown.values()) < 64 << 10, grown  # KiB: far below the 1 GiB described


def test_update_weights_from_disk_refuses_what_is_not_a_checkpoint(engine, tmp_path):
    """Issue 47, item 8: a ``*.safetensors`` link to /etc/shadow gave 500; a FIFO would block."""
    ids = greedy_ids(engine)
    link = tmp_path / "link"
    link.mkdir()
    (link / "model.safetensors").symlink_to("/etc/shadow")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")
    for d, words in [(link, "not a safetensors file"), (fifo, "not a regular file")]:
        status, out = call(base(engine), "POST", "/update_weights_from_disk", {"model_path": str(d)}, AUTH)
        assert status == 400 and words in out["message"] and "model.safetensors" in out["message"], out
        assert "root:" not in out["message"]
    assert greedy_ids(engine) == ids


@pytest.mark.parametrize("value", ["²", "9" * 5000, "0", "-3", "", " 5", "1e3", True, 5.0, 2**70, [7]],
                         ids=lambda v: repr(v)[:12])
def test_a_weight_version_that_is_not_a_plain_number_is_a_400_naming_it(engine, tmp_path, value):
    """Issue 47, item 8: "²" (a digit to str.isdigit, not to int) and 5,000 digits gave 500."""
    import torch

    name, shape = head_name(engine)
    for path, body in [("/update_weights_from_disk", {"model_path": str(tmp_path)}),
                       ("/update_weights_from_tensor", {"serialized_named_tensors": [by_value({name: torch.ones(shape)})]})]:
        status, out = call(base(engine), "POST", path, {**body, "weight_version": value}, AUTH)
        assert status == 400 and "weight_version" in out["message"], (path, out)


def test_the_workers_view_names_no_process_or_file(engine):
    """Issue 47, item 8: ``/belayer/workers`` told any key holder the arena's pid and start
    times (enough to name its shared-memory files); and those names hold a random token."""
    status, view = call(base(engine), "GET", "/belayer/workers", headers=AUTH)
    assert status == 200 and "w0" in view["slots"], view
    text = str(view)
    pids = {str(engine.status()["slots"]["w0"][k]) for k in ("arena_pid", "worker_pid", "shadow_pid")}
    assert "pid" not in text and "wall" not in text and not any(f" {p}," in text or f" {p}}}" in text for p in pids)
    for p in arena_files(engine):
        token = p.name.split("-")[4]
        assert p.name not in text and len(token) == 32 and int(token, 16) >= 0, p.name
    assert not [e for e in engine.events() if e["event"] in HANDOVER_EVENTS]
    poll(lambda: call(base(engine), "GET", "/health")[0] == 200, 10, "a healthy engine")
