"""Recording SGLang exchanges, and comparing two recordings: the machinery behind the replay fixtures.

:class:`RecordingProxy` is an HTTP proxy on 127.0.0.1 that forwards every request to a server (a real
``sglang.launch_server``, or the stand-in) and records each exchange: the step it belongs to (set by the
driver with :meth:`RecordingProxy.step`), method, route, request JSON, status, response JSON, and when it
started and ended relative to the step (so a replay can send concurrent requests concurrently). Bodies are
stored :func:`normalise`d: base64 tensor payloads, timings and ids become type placeholders
(``"<float>"``), long lists keep their length and first items. :func:`write_fixtures` writes one JSON
file per step (``NN-step.json``); :func:`differences` compares an answer with a recorded one: the status,
every key, every value's type (a volatile value's too: its placeholder names it), and the values known to
be deterministic (:data:`EXACT_KEYS`, plus the step's own ``exact`` paths). A value under one of the
step's ``loose`` paths may differ, shape included (``finish_reason`` ``{"type": "length", "length": n}``
where the stand-in stopped: ``{"type": "stop", "matched": x}``); its common keys keep their types.

``/server_info`` answers every ``ServerArgs`` field (about 460 in 0.5.17), GPU configuration the adapter
never reads and a stand-in cannot have: it is compared by a :class:`RouteRule`
(:func:`server_info_rule`): the keys the adapter reads (:data:`SERVER_INFO_READ`), with their values, and
the keys of a list kept beside the fixtures (``server_info_keys.txt``), with their types and, where the
list says so, values; every listed key must be in the recording, and no key outside the recording may be
answered.

Routes and reply shapes follow SGLang v0.5.17 (``sglang/srt/entrypoints/http_server.py``,
``sglang/srt/managers/io_struct.py``); nothing here imports sglang.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "EXACT_KEYS",
    "Exchange",
    "RecordingProxy",
    "StepRecord",
    "differences",
    "normalise",
    "read_fixtures",
    "server_info_rule",
    "write_fixtures",
]

FORMAT = "ppo-sglang-exchanges/1"
# Fields whose values change from run to run (timings, request ids, ports): their type is kept.
VOLATILE_KEYS = frozenset(
    {
        "id",
        "rid",
        "e2e_latency",
        "response_sent_to_client_ts",
        "queue_time",
        "prefill_launch_delay",
        "prefill_launch_latency",
        "prefill_finished_ts",
        "request_received_ts",
        "inference_time",
        "startup_time",
        "master_port",
        "master_address",
        "group_name",
        "internal_states",
        "last_gen_throughput",
        "cached_tokens",
        "spec_verify_ct",
        "lora_id",
        "model_path",
        "tokenizer_path",
        "served_model_name",
        "root",
        "created",
        "max_model_len",
    }
)
PAYLOAD_KEYS = frozenset({"serialized_named_tensors", "serialized_tensors"})
# Values that a replay must reproduce exactly wherever they appear.
EXACT_KEYS = frozenset(
    {
        "success",
        "status",
        "weight_version",
        "new_version",
        "is_generation",
        "version",
        "tp_size",
        "dp_size",
        "pp_size",
        "object",
        "code",
        "finish_reason",
        "completion_tokens",
        "prompt_tokens",
    }
)
# What the adapter reads of /server_info (ppo_weight_sync.endpoints, ppo_weight_sync.sglang.group_ranks_of)
SERVER_INFO_READ = ("version", "tp_size", "dp_size", "pp_size")
LIST_HEAD = 3  # items kept of a list longer than LIST_KEEP
LIST_KEEP = 8


@dataclass(frozen=True)
class RouteRule:
    """How a route's body is compared where it is too large to compare whole: only ``keys`` of its top
    level must be answered (each with the recorded type), those of ``exact`` with the recorded value too;
    each must be in the recording, and the answer may hold no key the recording lacks."""

    keys: tuple[str, ...]
    exact: tuple[str, ...] = ()


def server_info_rule(key_list: Path | str) -> dict[str, RouteRule]:
    """``/server_info``'s rule (both its routes): :data:`SERVER_INFO_READ`, exact, and the keys of
    ``key_list`` (one a line, ``#`` comments; ``name value``: its value must match too)."""
    keys: list[str] = list(SERVER_INFO_READ)
    exact: list[str] = list(SERVER_INFO_READ)
    for n, line in enumerate(Path(key_list).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2 or words[1:] not in ([], ["value"]):
            raise ValueError(f"{key_list}:{n}: {line!r} is not 'key' or 'key value'")
        if words[0] not in keys:
            keys.append(words[0])
        if words[1:] == ["value"] and words[0] not in exact:
            exact.append(words[0])
    rule = RouteRule(tuple(keys), tuple(exact))
    return {"/server_info": rule, "/get_server_info": rule}


def _placeholder(value: Any) -> str:
    return f"<{type(value).__name__}>" if value is not None else "<None>"


def normalise(value: Any, key: str | None = None) -> Any:
    """``value`` as a fixture holds it: volatile fields and tensor payloads as type placeholders, long
    lists as ``{"$len": n, "$head": [first items]}``. Idempotent: a normalised value normalises to itself."""
    if key in VOLATILE_KEYS and not isinstance(value, (dict, list)):
        return value if isinstance(value, str) and value.startswith("<") else _placeholder(value)
    if key in PAYLOAD_KEYS:
        items = value if isinstance(value, list) else [value]
        return [v if isinstance(v, str) and v.startswith("<") else "<base64>" for v in items]
    if isinstance(value, Mapping):
        if set(value) == {"$len", "$head"}:
            return dict(value)
        return {str(k): normalise(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > LIST_KEEP:
            return {"$len": len(value), "$head": [normalise(v) for v in value[:LIST_HEAD]]}
        return [normalise(v) for v in value]
    return value


@dataclass(frozen=True)
class Exchange:
    """One request and its answer. ``start`` and ``end``: seconds since the step began (ms precision);
    ``status`` 0: the connection dropped without an answer (the server died)."""

    method: str
    route: str
    request: Any
    status: int
    response: Any
    start: float
    end: float

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Exchange:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass
class StepRecord:
    """One step of a scenario: its exchanges in the order they started, and how to compare them:
    ``exact``: paths (``a.b``, ``*`` for any list index or key) whose values must be reproduced beyond
    :data:`EXACT_KEYS`; ``loose``: paths whose values may differ although their key is in EXACT_KEYS;
    ``subset``: for these routes only the listed keys must be present (``/server_info`` lists every
    server argument, of which the adapter reads four)."""

    name: str
    exchanges: list[Exchange] = field(default_factory=list)
    exact: list[str] = field(default_factory=list)
    loose: list[str] = field(default_factory=list)
    subset: dict[str, list[str]] = field(default_factory=dict)
    needs: str = ""  # "" (replayable as recorded), "peer" (a weight group or IPC sender), "cuda"
    note: str = ""


class _ProxyHandler(BaseHTTPRequestHandler):
    server: _ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def do_PUT(self) -> None:
        self._forward("PUT")

    def _forward(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        proxy = self.server.owner
        started = proxy.now()
        try:
            kind = self.headers.get("Content-Type", "application/json")
            status, content_type, body = proxy.upstream(method, self.path, raw, {"Content-Type": kind})
        except (OSError, http.client.HTTPException):
            proxy.record(method, self.path, raw, 0, b"<connection dropped>", started)
            self.close_connection = True
            return
        proxy.record(method, self.path, raw, status, body, started)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: RecordingProxy


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")


class RecordingProxy:
    """Forwards ``http://127.0.0.1:<port>`` to ``upstream`` and records every exchange under the current
    step. Use as a context manager; :attr:`url` is where clients connect."""

    def __init__(self, upstream: str, timeout_s: float = 600.0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self._host, self._port = parts.hostname, parts.port or 80
        self.timeout_s = timeout_s
        self.steps: list[StepRecord] = []
        self._lock = threading.Lock()
        self._step_t0 = time.monotonic()
        self._local = threading.local()
        self._server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def now(self) -> float:
        return round(time.monotonic() - self._step_t0, 3)

    @contextlib.contextmanager
    def step(self, name: str, **compare: Any) -> Iterator[StepRecord]:
        """Exchanges until the block ends belong to step ``name`` (``compare``: StepRecord's fields)."""
        record = StepRecord(name, **compare)
        with self._lock:
            self.steps.append(record)
            self._step_t0 = time.monotonic()
        yield record

    def upstream(
        self, method: str, path: str, raw: bytes, headers: Mapping[str, str]
    ) -> tuple[int, str, bytes]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(
                self._host, self._port, timeout=self.timeout_s
            )
        send = {"Content-Type": headers.get("Content-Type", "application/json")} if raw else {}
        try:
            conn.request(method, path, body=raw or None, headers=send)
            resp = conn.getresponse()
            body = resp.read()
        except Exception:
            conn.close()
            self._local.conn = None
            raise
        return resp.status, resp.getheader("Content-Type", "application/json"), body

    def record(self, method: str, path: str, raw: bytes, status: int, body: bytes, started: float) -> None:
        exchange = Exchange(
            method=method,
            route=path,
            request=normalise(_decode(raw)),
            status=status,
            response=normalise(_decode(body)),
            start=started,
            end=self.now(),
        )
        with self._lock:
            if not self.steps:
                self.steps.append(StepRecord("unlabelled"))
            self.steps[-1].exchanges.append(exchange)
            self.steps[-1].exchanges.sort(key=lambda e: e.start)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RecordingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_fixtures(folder: Path | str, steps: Sequence[StepRecord], meta: Mapping[str, Any]) -> list[Path]:
    """One file per step, ``NN-<step>.json`` in order, plus ``meta.json`` (``meta``: the server, the model,
    the argv); files of an earlier recording in ``folder`` are removed first."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("[0-9][0-9]-*.json"):
        old.unlink()
    (folder / "meta.json").write_text(json.dumps({"format": FORMAT, **meta}, indent=1) + "\n")
    paths = []
    for i, step in enumerate(steps):
        path = folder / f"{i:02d}-{_slug(step.name)}.json"
        path.write_text(json.dumps({"format": FORMAT, **asdict(step)}, indent=1) + "\n")
        paths.append(path)
    return paths


def read_fixtures(folder: Path | str) -> tuple[dict[str, Any], list[tuple[Path, StepRecord]]]:
    """``meta.json`` and every step file, in order; ValueError naming a file that is not a step record."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    steps = []
    for path in sorted(folder.glob("*.json")):
        if path.name == "meta.json":
            continue
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r} is not {FORMAT!r}; re-record it")
        exchanges = [Exchange.from_json(e) for e in data.pop("exchanges")]
        data.pop("format")
        steps.append((path, StepRecord(exchanges=exchanges, **data)))
    return meta, steps


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(re.fullmatch(re.escape(p).replace(r"\*", r"[^.]+"), path) for p in patterns)


def _is_loose(path: str, step: StepRecord) -> bool:
    return any(_matches(".".join(path.split(".")[: i + 1]), step.loose) for i in range(path.count(".") + 1))


def differences(
    recorded: Any,
    answered: Any,
    step: StepRecord,
    route: str = "",
    path: str = "",
    key: str | None = None,
    inherited: bool = False,
    rules: Mapping[str, RouteRule] | None = None,
) -> list[str]:
    """How ``answered`` (normalised here) differs from ``recorded``: a missing or extra key (not under a
    loose path), another type (a volatile value's placeholder included), another list length (unless the
    path is loose), another value where the value is exact (its key is in :data:`EXACT_KEYS`, or its path
    or a parent's is in ``step.exact``; never under a loose path). ``rules``: :class:`RouteRule` by route,
    for the top level of those routes' bodies (before ``step.subset``)."""
    answered = normalise(answered, key)
    loose = _is_loose(path, step)
    exact = not loose and (inherited or key in EXACT_KEYS or _matches(path, step.exact))
    where = path or "(body)"
    if type(recorded) is not type(answered):
        return [
            f"{where}: {type(answered).__name__} {str(answered)[:80]!r}, recorded {type(recorded).__name__}"
        ]
    if isinstance(recorded, dict):
        rule = (rules or {}).get(route) if not path else None
        return _dict_differences(recorded, answered, step, route, path, exact, rule)
    if isinstance(recorded, list):
        out = []
        if not loose and len(recorded) != len(answered):
            out.append(f"{where}: {len(answered)} items, recorded {len(recorded)}")
        for i, (a, b) in enumerate(zip(recorded, answered, strict=False)):
            out += differences(a, b, step, route, f"{path}.{i}".lstrip("."), None, exact)
        return out
    placeholder = key in VOLATILE_KEYS and isinstance(recorded, str) and recorded.startswith("<")
    if (exact or placeholder or (not path and isinstance(recorded, str))) and recorded != answered:
        return [f"{where}: {answered!r}, recorded {recorded!r}"]
    return []


def _dict_differences(
    recorded: dict[str, Any],
    answered: dict[str, Any],
    step: StepRecord,
    route: str,
    path: str,
    exact: bool,
    rule: RouteRule | None,
) -> list[str]:
    out: list[str] = []
    where = path or "(body)"
    if "$len" in recorded:
        if not _is_loose(path, step) and recorded["$len"] != answered.get("$len"):
            out.append(f"{where}: {answered.get('$len')} items, recorded {recorded['$len']}")
        return out + differences(recorded["$head"], answered.get("$head"), step, route, path, None, exact)
    wanted = rule.keys if rule is not None else step.subset.get(route) if not path else None
    keys = set(wanted) if wanted is not None else set(recorded)
    if not _is_loose(path, step):  # a loose value may be another shape of it
        missing = sorted(keys - set(answered))
        extra = sorted(set(answered) - set(recorded)) if wanted is None or rule is not None else []
        unknown = sorted(keys - set(recorded)) if rule is not None else []
        out += [f"{where}: keys {missing} missing"] if missing else []
        out += [f"{where}: keys {extra} not in the recording"] if extra else []
        out += [f"{where}: listed keys {unknown} are not in the recording"] if unknown else []
    pinned = set(rule.exact) if rule is not None else set()
    for k in sorted(keys & set(answered) & set(recorded)):
        sub = f"{path}.{k}".lstrip(".")
        out += differences(recorded[k], answered[k], step, route, sub, k, exact or k in pinned)
    return out
