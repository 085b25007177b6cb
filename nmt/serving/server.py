"""``nmt serve``: an HTTP translation server over the same Translator as the Python API.

    POST /translate  {"text": ["...", ...], "beam": 4, ...}  ->  {"translations": [...], "scores": [...]}
    GET  /health     {"status": "ok", ...}
    GET  /info       arch, vocabularies, languages, precision, version, limits

Starlette on uvicorn (the ``nmt[serve]`` extra). Safe by default: it binds to 127.0.0.1, and any
other address needs an API key, checked on every request. Every bad request gets a 4xx with a
JSON ``{"error": "one line"}``; load beyond the limits gets 413 (request too large), 429 (too
many sentences waiting) or 503 (not answered within the request timeout), never a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import math
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from nmt.device_options import PANEL as DEVICE_PANEL, InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.generation.inference import check_lengths, encode_sources, translate_ids
from nmt.generation.options import BatchingOptions, SearchOptions
from nmt.generation.translator import Translator
from nmt.log import logger
from nmt.options import check_values
from nmt.serving.batcher import Batcher, QueueFull
from nmt.version import __version__

API_KEY_ENV = "NMT_API_KEY"
MAX_LEN_A, MAX_LEN_B = 4.0, 512  # output length limits: a request cannot make the server decode for ever
# What a request may set: the deterministic search options (sampling would depend on the batch).
REQUEST_OPTIONS = ("beam", "lenpen", "lenpen_style", "max_len_a", "max_len_b", "min_len", "no_repeat_ngram_size",
                   "nbest", "stop", "shortlist")


@dataclass(frozen=True)
class ServeOptions:
    path: str = field(default="checkpoints/checkpoint_best.pt", metadata={
        "help": "Checkpoint to serve; a.pt:b.pt serves an ensemble."})
    host: str = field(default="127.0.0.1", metadata={
        "help": "Address to bind; anything but loopback needs --api-key."})
    port: int = field(default=8080, metadata={"help": "Port to bind (0: a free one, logged).", "min": 0,
                                              "max": 65535})
    api_key: str | None = field(default=None, metadata={
        "help": f"Require this key on every request (Authorization: Bearer KEY or X-API-Key); env {API_KEY_ENV}."})
    compute: InferenceDeviceOptions = field(default_factory=InferenceDeviceOptions, metadata={
        "help": "Device options.", "panel": DEVICE_PANEL})
    max_sentences: int = field(default=64, metadata={"help": "Sentences per request at most (413 beyond).",
                                                     "min": 1})
    max_characters: int = field(default=20_000, metadata={"help": "Characters per request at most (413 beyond).",
                                                          "min": 1})
    max_beam: int = field(default=16, metadata={"help": "Largest beam a request may ask for.", "min": 1})
    max_queue: int = field(default=1024, metadata={
        "help": "Sentences waiting or being translated at most; more answer 429.", "min": 1})
    batch_window_ms: float = field(default=5.0, metadata={
        "help": "How long the first request of a batch waits for others to join it.", "min": 0})
    max_batch_tokens: int = field(default=BatchingOptions.max_tokens, metadata={
        "help": "Source tokens x beam gathered into one batch at most.", "min": 1})
    request_timeout: float = field(default=60.0, metadata={
        "help": "Seconds a request may wait for its translation; later it answers 503.", "min": 0.001})

    def validate(self) -> None:
        check_values(self)
        if self.max_queue < self.max_sentences:
            raise NmtError(f"--max-queue {self.max_queue} is below --max-sentences {self.max_sentences}: a full request "
                           "would always be refused (429)")
        if not is_loopback(self.host) and not self.api_key:
            raise NmtError(f"binding to {self.host} exposes the server beyond this machine: give --api-key KEY "
                           f"(or set {API_KEY_ENV})")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, options: ServeOptions) -> tuple[list[str], dict[str, Any]]:
    """The sentences and search options of a /translate body, or an ApiError saying what is wrong."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
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
    unknown = sorted(set(payload) - set(REQUEST_OPTIONS))
    if unknown:
        raise ApiError(422, f"unknown field(s) {', '.join(unknown)}; known: text, {', '.join(REQUEST_OPTIONS)}")
    defaults = SearchOptions()
    for name, value in payload.items():
        expected = type(getattr(defaults, name))
        number = expected is float and isinstance(value, int)
        if isinstance(value, bool) or not (isinstance(value, expected) or number) or \
                (expected is float and not math.isfinite(value)):
            wanted = {float: "a finite number", int: "an integer", str: "a string"}[expected]
            raise ApiError(422, f'"{name}" must be {wanted}, got {json_type(value)}')
    limits = {"beam": options.max_beam, "max_len_a": MAX_LEN_A, "max_len_b": MAX_LEN_B}
    for name, most in limits.items():
        if payload.get(name, getattr(defaults, name)) > most:
            raise ApiError(422, f'"{name}" must be at most {most}')
    return text, payload


def json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def create_app(translator: Translator, options: ServeOptions):
    """The Starlette application: /translate, /health, /info."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    batching = BatchingOptions(max_tokens=options.max_batch_tokens)
    batcher = Batcher(lambda sources, search: translate_ids(translator.model, sources, search, batching,
                                                            translator.device, translator.precision,
                                                            shortlist=translator.vocabs.shortlist),
                      options.batch_window_ms / 1000, options.max_batch_tokens, options.max_queue)
    started = time.time()
    info = server_info(translator, options)

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
    async def translate(request: Request) -> dict[str, Any]:
        # JSON may escape every character as \uXXXX, twice for one outside the BMP: 12 bytes a character
        texts, overrides = parse_request(await read_body(request, options.max_characters * 12 + 65536), options)
        try:
            search, _ = translator.options(**overrides)
        except NmtError as exc:
            raise ApiError(422, str(exc)) from exc
        sources = encode_sources(translator.vocabs, texts)
        try:  # here, not in the batch: one request's sentence must not fail the others batched with it
            check_lengths(translator.model, sources)
        except NmtError as exc:
            raise ApiError(422, str(exc).replace("input line", "text")) from exc
        try:
            future = batcher.submit(sources, search)
        except QueueFull as exc:
            raise ApiError(429, str(exc)) from exc
        try:
            hypotheses = await asyncio.wait_for(future, options.request_timeout)
        except asyncio.TimeoutError as exc:
            raise ApiError(503, f"no translation within {options.request_timeout:g} s; the server is busy") from exc
        scored = [[translator.scored(h) for h in hyps] for hyps in hypotheses]
        if search.nbest == 1:
            return {"translations": [h[0].text for h in scored], "scores": [h[0].score for h in scored]}
        return {"translations": [[h.text for h in hyps] for hyps in scored],
                "scores": [[h.score for h in hyps] for hyps in scored]}

    @endpoint
    async def health(request: Request) -> dict[str, Any]:
        return {"status": "ok", "uptime_s": round(time.time() - started, 1), "waiting_sentences": batcher.waiting,
                "batches": batcher.stats.batches, "sentences": batcher.stats.sentences}

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

    routes = [Route("/translate", translate, methods=["POST"]), Route("/health", health, methods=["GET"]),
              Route("/info", describe, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def authorize(request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    given = request.headers.get("x-api-key") or (credentials.strip() if scheme.lower() == "bearer" else "")
    if not secrets.compare_digest(given.encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY or X-API-Key: KEY)")


async def read_body(request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the body has over {limit} bytes")
    return bytes(body)


def server_info(translator: Translator, options: ServeOptions) -> dict[str, Any]:
    from nmt.checkpoint.format import load_checkpoint
    from nmt.checkpoint.names import split_paths

    vocabs = translator.vocabs
    return {
        "version": __version__,
        "arch": [load_checkpoint(path, mmap=True)["arch"] for path in split_paths(translator.path)],
        "languages": {"source": vocabs.source_lang, "target": vocabs.target_lang},
        "vocab": {"source": len(vocabs.source), "target": len(vocabs.target), "joint": vocabs.joint,
                  "shortlist": vocabs.shortlist is not None},
        "device": str(translator.device), "precision": translator.precision, "quantize": translator.quantize,
        "limits": {"max_sentences": options.max_sentences, "max_characters": options.max_characters,
                   "max_beam": options.max_beam, "max_queue": options.max_queue},
        "defaults": {name: getattr(SearchOptions(), name) for name in REQUEST_OPTIONS},
    }


def serve(options: ServeOptions) -> None:
    """Check the options, load the model once, bind, and serve until interrupted."""
    options.validate()
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise NmtError("nmt serve needs its optional dependencies: pip install 'nmt[serve]'") from None
    translator = Translator.from_checkpoint(options.path, options.compute.device, options.compute.precision,
                                            options.compute.quantize)
    app = create_app(translator, options)
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((options.host, options.port))
    except OSError as exc:
        sock.close()
        raise NmtError(f"cannot bind {options.host}:{options.port}: {exc.strerror or exc}") from exc
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    logger.info("serving %s on http://%s:%d (POST /translate, GET /health, GET /info)", translator.path, shown, port)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
