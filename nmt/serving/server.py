"""``nmt serve``: an HTTP translation server over the same Translator as the Python API.

    POST /translate  {"text": ["...", ...], "beam": 4, ...}  ->  {"translations": [...], "scores": [...]}
                     optional controls: "prefix": [one string or null per text], "constraints": [one list
                     of strings per text], "ban": [strings] (nmt/generation/constraints.py)
    GET  /health     {"status": "ok", ...}
    GET  /info       arch, vocabularies, languages, precision, version, limits

Starlette on uvicorn (the ``serve`` extra). Safe by default: it binds to 127.0.0.1, and any
other address needs an API key, checked on every request. Every bad request gets a 4xx with a
JSON ``{"error": "one line"}``; load beyond the limits gets 408 (a body too slow to arrive), 413
(request too large), 429 (too many sentences waiting) or 503 (not answered within the request
timeout, or too many connections), never a crash. What a request may ask is bounded so that a
batch's memory is (nmt/serving/budget.py), and /info reports the bound of the whole process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import resource
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt.checkpoint.format import load_checkpoint
from nmt.checkpoint.names import split_paths
from nmt.data.vocabulary import EOS_ID
from nmt.device import use_threads
from nmt.errors import NmtError, install_hint
from nmt.generation.control_input import controls_from_lists
from nmt.generation.inference import check_controls, check_lengths, encode_sources, translate_ids, uses_shortlist
from nmt.generation.options import BatchingOptions, SearchOptions
from nmt.generation.search import HYPOTHESIS_BYTES_PER_TOKEN, max_lengths, model_positions
from nmt.generation.translator import Translator
from nmt.log import logger
from nmt.options import flag
from nmt.serving.batcher import Batcher, QueueFull
from nmt.serving.budget import SearchMemory
from nmt.serving.options import ServeOptions
from nmt.version import __version__

MAX_LEN_A = 4.0  # with --max-output-length, what keeps a request from making the server decode for ever
# JSON may escape every character as \uXXXX, twice for one outside the BMP: 12 bytes a character
BODY_BYTES_PER_CHARACTER, BODY_SLACK = 12, 65536
MIB = 2 ** 20
# What a request may set: the deterministic search options (sampling would depend on the batch).
REQUEST_OPTIONS = ("beam", "lenpen", "lenpen_style", "max_len_a", "max_len_b", "min_len", "no_repeat_ngram_size",
                   "nbest", "stop", "shortlist")
CONTROL_FIELDS = ("prefix", "constraints", "ban")  # passed to controls_from_lists


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def body_limit(options: ServeOptions) -> int:
    return options.max_characters * BODY_BYTES_PER_CHARACTER + BODY_SLACK


def parse_request(body: bytes, options: ServeOptions) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The sentences, search options and controls of a /translate body, or an ApiError saying what is wrong."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON here: it nests too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ApiError(400, f"the body is not valid JSON here: {str(exc).split(';')[0]}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, 'the body must be a JSON object like {"text": ["a sentence"]}')
    text = payload.pop("text", None)
    if not isinstance(text, list) or not text or not all(isinstance(t, str) for t in text):
        raise ApiError(422, '"text" must be a non-empty list of strings')
    for number, sentence in enumerate(text, start=1):
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError:  # JSON can escape half of a UTF-16 pair ("\ud800"): not a character
            raise ApiError(422, f'"text" sentence {number} holds a lone surrogate escape, not a character') from None
    if len(text) > options.max_sentences:
        raise ApiError(413, f"{len(text)} sentences in one request; at most {options.max_sentences}")
    characters = sum(len(t) for t in text)
    if characters > options.max_characters:
        raise ApiError(413, f"{characters} characters in one request; at most {options.max_characters}")
    controls = {name: payload.pop(name) for name in CONTROL_FIELDS if name in payload}
    unknown = sorted(set(payload) - set(REQUEST_OPTIONS))
    if unknown:
        raise ApiError(422, f"unknown field(s) {', '.join(unknown)}; known: text, {', '.join(REQUEST_OPTIONS)}, "
                            f"{', '.join(CONTROL_FIELDS)}")
    defaults = SearchOptions()
    for name, value in payload.items():
        expected = type(getattr(defaults, name))
        number = expected is float and isinstance(value, int)
        if isinstance(value, bool) or not (isinstance(value, expected) or number) or \
                (expected is float and not math.isfinite(value)):
            wanted = {float: "a finite number", int: "an integer", str: "a string"}[expected]
            raise ApiError(422, f'"{name}" must be {wanted}, got {json_type(value)}')
    most_output = options.max_output_length
    limits = {"beam": (options.max_beam, "--max-beam"), "max_len_a": (MAX_LEN_A, ""),
              "max_len_b": (most_output, "--max-output-length"), "min_len": (most_output, "--max-output-length"),
              "no_repeat_ngram_size": (most_output, "--max-output-length")}
    for name, (most, server_flag) in limits.items():
        if payload.get(name, getattr(defaults, name)) > most:
            raise ApiError(422, f'"{name}" must be at most {most:g}' +
                           (f" (the server's {server_flag})" if server_flag else ""))
    return text, payload, controls


def output_limits(model, sources: list, search: SearchOptions, options: ServeOptions) -> list[int]:
    """The longest output each source may reach, or a 422 for one beyond --max-output-length."""
    lengths = torch.tensor([len(source) - 1 for source in sources])  # EOS excluded
    limits = max_lengths(lengths, search.max_len_a, search.max_len_b, model_positions(model)).tolist()
    for number, (length, limit) in enumerate(zip(lengths.tolist(), limits), start=1):
        if limit > options.max_output_length:
            raise ApiError(422, f"text {number} may reach {limit} output tokens (max_len_a {search.max_len_a:g} x "
                                f"its {length} tokens + max_len_b {search.max_len_b}); the server's "
                                f"--max-output-length is {options.max_output_length}: lower max_len_a or max_len_b")
    return limits


def in_request_terms(message: str) -> str:
    """An option's error as a request names the option: "beam", not --beam (whole flags only:
    --lenpen is not the start of --lenpen-style)."""
    fields = {flag(name): f'"{name}"' for name in REQUEST_OPTIONS}
    return re.sub(r"--[a-z0-9-]+", lambda found: fields.get(found.group(0), found.group(0)), message)


def json_type(value: Any) -> str:
    """What a JSON value is, in words; NaN and the infinities (which Python's json reads) by name."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def create_app(translator: Translator, options: ServeOptions, baseline: int = 0):
    """The Starlette application: /translate, /health, /info. ``baseline``: the bytes the process held
    before serving (the model loaded), for the memory bound /info reports."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    memory = SearchMemory(translator.model, translator.precision, translator.device.type)
    budget = batch_budget(translator, memory, options)
    batching = BatchingOptions(max_tokens=None, batch_size=options.max_queue)  # the batcher sized the batch

    def translate(sources, search, controls, should_stop):
        return translate_ids(translator.model, sources,
                             translator.request(search, batching, controls=controls, should_stop=should_stop))

    # A sentence searching over a quarter of the longest search the limits allow is heavy (see batcher.py).
    batcher = Batcher(translate, options.batch_window_ms / 1000, memory, budget, options.max_queue,
                      long_search=options.max_beam * options.max_output_length // 4)
    started = time.time()
    info = server_info(translator, options, memory_bound(options, baseline, budget))

    def endpoint(handler):
        """Checks the API key, and turns an ApiError into its JSON answer."""
        async def wrapped(request: Request) -> JSONResponse:
            try:
                authorize(request, options.api_key)
                return JSONResponse(await handler(request))
            except ApiError as exc:
                headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
                return JSONResponse({"error": str(exc)}, status_code=exc.status, headers=headers)
            except Exception as exc:  # noqa: BLE001  (a failed translation must not take the server down)
                logger.exception("%s %s failed", request.method, request.url.path)
                return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)
        return wrapped

    @endpoint
    async def translate_endpoint(request: Request) -> dict[str, Any]:
        texts, overrides, given = parse_request(await read_body(request, body_limit(options), options.body_timeout),
                                                options)
        try:
            search, _ = translator.options(**overrides)
        except NmtError as exc:
            raise ApiError(422, in_request_terms(str(exc))) from exc
        sources = encode_sources(translator.vocabs, texts)
        try:  # here, not in the batch: one request's sentence must not fail the others batched with it
            check_lengths(translator.model, sources)
            controls = controls_from_lists(translator.vocabs.target, len(texts),
                                           *(given.get(f) for f in CONTROL_FIELDS),
                                           names=tuple(f'"{f}"' for f in CONTROL_FIELDS))
            if controls is not None:
                controls = check_controls(sources, controls, search, model_positions(translator.model))
        except NmtError as exc:
            raise ApiError(422, str(exc).replace("input line", "text")) from exc
        try:
            future = batcher.submit(sources, search, output_limits(translator.model, sources, search, options),
                                    controls)
        except QueueFull as exc:
            raise ApiError(429, str(exc)) from exc
        hypotheses = await answer_or_give_up(request, future, options.request_timeout)
        scored = [[translator.scored(h) for h in hyps] for hyps in hypotheses]
        if search.nbest == 1:
            return {"translations": [h[0].text for h in scored], "scores": [h[0].score for h in scored]}
        return {"translations": [[h.text for h in hyps] for hyps in scored],
                "scores": [[h.score for h in hyps] for hyps in scored]}

    @endpoint
    async def health(request: Request) -> dict[str, Any]:
        return {"status": "ok", "uptime_s": round(time.time() - started, 1), "waiting_sentences": batcher.waiting,
                "batches": batcher.stats.batches, "sentences": batcher.stats.sentences,
                "abandoned_sentences": batcher.stats.abandoned}

    @endpoint
    async def describe(request: Request) -> dict[str, Any]:
        return info

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker = asyncio.create_task(batcher.run())
        yield
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker

    routes = [Route("/translate", translate_endpoint, methods=["POST"]), Route("/health", health, methods=["GET"]),
              Route("/info", describe, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def authorize(request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    given = request.headers.get("x-api-key") or (credentials.strip() if scheme.lower() == "bearer" else "")
    if not secrets.compare_digest(given.encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY or X-API-Key: KEY)")


async def read_body(request, limit: int, timeout: float) -> bytes:
    """The request body, refusing more than ``limit`` bytes without reading it all, or one that takes
    more than ``timeout`` seconds to arrive (a slow client would hold its connection for ever)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; at most {limit}")

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the body has over {limit} bytes")
        return bytes(body)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout:g} s") from None


async def answer_or_give_up(request, future: asyncio.Future, timeout: float) -> list:
    """The request's translations; if they do not come within ``timeout`` or the client leaves, the
    future is cancelled, which takes the request out of the batcher (and stops a batch of only it)."""
    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(client_left())
    try:
        done, _ = await asyncio.wait({future, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if future in done:
        return future.result()
    future.cancel()
    if watch in done:
        raise ApiError(499, "the client closed the connection")  # nobody reads it
    raise ApiError(503, f"no translation within {timeout:g} s; the server is busy")


def batch_budget(translator: Translator, memory: SearchMemory, options: ServeOptions) -> int:
    """The bytes a batch may take. Every request the limits allow must fit one batch: the heaviest
    sentence alone (the longest source the model takes, at --max-beam, reaching --max-output-length)."""
    longest_source = min(model_positions(translator.model) or math.inf, 4 * options.max_characters + 1)  # UTF-8 bytes
    needed = memory.batch([options.max_output_length], options.max_beam, longest_source)
    if options.max_batch_memory is None:
        return max(1024 * MIB, needed)
    if needed > options.max_batch_memory * MIB:
        raise NmtError(f"--max-batch-memory {options.max_batch_memory} MiB cannot hold one sentence at --max-beam "
                       f"{options.max_beam} and --max-output-length {options.max_output_length} "
                       f"({math.ceil(needed / MIB)} MiB for this model): raise it or lower those")
    return options.max_batch_memory * MIB


def memory_bound(options: ServeOptions, baseline: int, budget: int) -> dict[str, int]:
    """What the process may hold, in MiB: before serving, one batch, the bodies being read, the answers."""
    bodies = options.max_connections * 3 * body_limit(options)  # the bytes read, joined, decoded
    answers = options.max_queue * options.max_beam * (options.max_output_length + 1) * HYPOTHESIS_BYTES_PER_TOKEN
    parts = {"before_serving": baseline, "batches": 2 * budget, "bodies": bodies, "answers": answers}  # 2 workers
    return {**{name: math.ceil(size / MIB) for name, size in parts.items()},
            "total": math.ceil(sum(parts.values()) / MIB)}


def peak_memory() -> int:
    """This process's peak resident set so far, in bytes (Linux's VmHWM: getrusage's counts the parent's
    memory at fork too, across exec)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def server_info(translator: Translator, options: ServeOptions, memory: dict[str, int]) -> dict[str, Any]:
    vocabs = translator.vocabs
    return {
        "version": __version__,
        "arch": [load_checkpoint(path, mmap=True)["arch"] for path in split_paths(translator.path)],
        "languages": {"source": vocabs.source_lang, "target": vocabs.target_lang},
        "vocab": {"source": len(vocabs.source), "target": len(vocabs.target), "joint": vocabs.joint,
                  "shortlist": uses_shortlist(SearchOptions(), vocabs.shortlist, translator.device.type)},
        "device": str(translator.device), "precision": translator.precision, "quantize": translator.decoding.quantize,
        "stop": translator.decoding.stop,
        "limits": {"max_sentences": options.max_sentences, "max_characters": options.max_characters,
                   "max_body_bytes": body_limit(options), "max_beam": options.max_beam,
                   "max_output_length": options.max_output_length, "max_queue": options.max_queue,
                   "max_connections": options.max_connections},
        "memory_mib": memory,
        "defaults": {name: getattr(SearchOptions(), name) for name in REQUEST_OPTIONS},
    }


def serve(options: ServeOptions) -> None:
    """Check the options, load the model once, bind, and serve until interrupted."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise NmtError(f"nmt serve needs its optional dependencies: {install_hint('serve')}") from None
    use_threads(options.compute.threads)
    translator = Translator.from_checkpoint(options.path, options.compute.device, options.compute.precision,
                                            options.compute.quantize, options.compute.backend)
    # torch's first call allocates its own buffers: before the memory at start is taken
    translate_ids(translator.model, [np.full(2, EOS_ID)],
                  translator.request(SearchOptions(beam=1, max_len_b=1, stop="exact"), BatchingOptions()))
    app = create_app(translator, options, peak_memory())
    # uvicorn refuses a request when its connection brings the open ones to limit_concurrency
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            limit_concurrency=options.max_connections + 1)
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((options.host, options.port))
        sock.listen(config.backlog)  # before the address is logged: a client that reads it may connect at once
    except OSError as exc:
        sock.close()
        raise NmtError(f"cannot bind {options.host}:{options.port}: {exc.strerror or exc}") from exc
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    logger.info("serving %s on http://%s:%d (POST /translate, GET /health, GET /info); %s", translator.path, shown,
                port, translator.decoding.describe())
    server_stopping_in_two_steps(uvicorn.Server)(config).run(sockets=[sock])


def server_stopping_in_two_steps(base: type) -> type:
    """uvicorn's server (``base``: uvicorn is imported only when serving), saying what a signal does:
    the first lets the requests in progress be answered, a second ends the process at once and
    quietly (uvicorn's own second Ctrl-C cancels them in the middle: tracebacks, and 500s)."""

    class Server(base):
        def handle_exit(self, sig: int, frame: Any) -> None:
            name = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
            if self.should_exit:
                logger.warning("%s: stopped at once, requests in progress unanswered", name)
                os._exit(128 + sig)  # nothing of the user's is being written: the server writes no files
            else:
                logger.warning("%s: stopping once the requests in progress are answered (a second Ctrl-C or "
                               "SIGTERM stops at once)", name)
                super().handle_exit(sig, frame)

    return Server
