"""``nmt serve``: an HTTP translation server over the same Translator as the Python API.

    POST /translate  {"text": ["...", ...], "beam": 4, ...}  ->  {"translations": [...], "scores": [...]}
                     optional controls: "prefix": [one string or null per text], "constraints": [one list
                     of strings per text], "ban": [strings] (nmt/generation/constraints.py)
    GET  /health     {"status": "ok", ...}
    GET  /info       arch, vocabularies, languages, precision, version, limits

Starlette on uvicorn (the ``serve`` extra). Safe by default: it binds to 127.0.0.1, and any
other address needs an API key, checked on every request; requests a web page could send are
refused (nmt/serving/guards.py). Every bad request gets a 4xx with a JSON ``{"error": "one
line"}``: 403 (a foreign Origin or Host), 408 (a body too slow to arrive), 413 (request too large),
415 (a body not sent as JSON), 429 (too many sentences waiting), 499 (the client left), 503 (not
answered within the request timeout, or too many requests at once), never a crash or a
traceback. What a request may ask is bounded (nmt/serving/request.py) so that a batch's memory
is (nmt/serving/budget.py), and /info reports the bound of the whole server, its worker processes
included. On Linux and a CPU, batches are decoded in worker processes forked at start, one per
--threads (nmt/serving/processes.py); elsewhere on a thread of the server's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nmt.checkpoint.format import load_checkpoint
from nmt.checkpoint.names import split_paths
from nmt.data.vocabulary import EOS_ID
from nmt.device import use_threads
from nmt.errors import NmtError, Stopped, install_hint
from nmt.generation.decoding_settings import DecodingSettings, for_search
from nmt.generation.inference import translate_ids, uses_shortlist
from nmt.generation.options import BatchingOptions, SearchOptions
from nmt.generation.search import HYPOTHESIS_BYTES_PER_TOKEN, SearchStopped, model_positions
from nmt.generation.translator import Translator
from nmt.log import logger
from nmt.serving.batcher import Batcher, QueueFull, TranslateFn, WorkerGone
from nmt.serving.budget import ControlShape, SearchMemory
from nmt.serving.connections import with_idle_deadline
from nmt.serving.guards import check_caller, check_json_body
from nmt.serving.options import ServeOptions
from nmt.serving.processes import ForkedTranslate, fork_decoders
from nmt.serving.request import REQUEST_OPTIONS, ApiError, body_limit, prepare
from nmt.version import __version__

MIB = 2 ** 20
IDLE_CONNECTIONS_PER_REQUEST = 4  # open connections at most, per request the server handles at once
CONNECTION_BYTES = 16 * 1024 + 256 * 1024  # a request head's buffer (h11's limit) and one read from its socket
CLIENT_LEFT = 499  # nginx's status for a request whose client closed the connection: nobody reads it
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def create_app(translator: Translator, options: ServeOptions, baseline: int = 0,
               decoders: list[ForkedTranslate] | None = None):
    """The Starlette application: /translate, /health, /info. ``baseline``: the bytes the process held
    before serving (the model loaded), for the memory bound /info reports; ``decoders``: the worker
    processes that decode the light batches (none: a thread of this process does)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    decoders = decoders or []
    memory = SearchMemory(translator.model, translator.precision, translator.device.type)
    budget = batch_budget(translator, memory, options)
    # A sentence searching over a quarter of the longest search the limits allow is heavy (see batcher.py).
    batcher = Batcher(batch_translator(translator), options.batch_window_ms / 1000, memory, budget, options.max_queue,
                      long_search=options.max_beam * options.max_output_length // 4, light=decoders)
    started = time.time()
    info = server_info(translator, options, memory_bound(options, baseline, budget, len(decoders)))
    translating = 0  # /translate requests in progress: at most --max-connections

    def endpoint(handler):
        """Checks who asks, and turns an ApiError into its JSON answer."""
        async def wrapped(request: Request) -> JSONResponse:
            try:
                check_caller(request.headers, options.api_key)
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
        nonlocal translating
        if translating >= options.max_connections:
            raise ApiError(503, f"{translating} requests are being handled (the server's --max-connections); "
                                "retry later")
        translating += 1
        try:
            return await translate_request(request)
        finally:
            translating -= 1

    async def translate_request(request: Request) -> dict[str, Any]:
        check_json_body(request.headers)
        body = await read_body(request, body_limit(options), options.body_timeout)
        left = asyncio.ensure_future(client_left(request))
        try:
            try:  # in a thread: encoding and checking a large request must not hold the other clients
                prepared = await asyncio.to_thread(prepare, translator, body, options, left.done)
            except SearchStopped:
                raise ApiError(CLIENT_LEFT, "the client closed the connection") from None
            try:
                future = batcher.submit(prepared.sources, prepared.search, prepared.output_limits, prepared.controls)
            except QueueFull as exc:
                raise ApiError(429, str(exc)) from exc
            try:
                hypotheses = await answer_or_give_up(future, left, options.request_timeout)
            except WorkerGone:  # logged once by the batcher (with the process and how it ended), not for each request
                raise ApiError(500, "the decoding worker process that had this request ended; the server goes on "
                                    "with the others") from None
        finally:
            left.cancel()
        scored = [[translator.scored(h) for h in hyps] for hyps in hypotheses]
        if prepared.search.nbest == 1:
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


def batch_translator(translator: Translator) -> TranslateFn:
    """What a worker calls with a batch: translate_ids on it whole, with the thread count of where it
    runs (a forked worker's one, or --threads on a thread of this process). Cut into one part per
    thread, each searched on a Python thread, the parts served fewer sentences than the whole batch
    on two threads: 92 against 113 a second with 32 clients on a 2-core Zen 4
    (benchmarks/notes/amd-epyc-zen4-2026-11-28.md)."""
    def translate(sources, search, controls, should_stop):
        batching = BatchingOptions(max_tokens=None, batch_size=len(sources), workers=1)
        return translate_ids(translator.model, sources,
                             translator.request(search, batching, controls=controls, should_stop=should_stop))

    return translate


async def read_body(request, limit: int, timeout: float) -> bytes:
    """The request body, refusing more than ``limit`` bytes without reading it all, or one that takes
    more than ``timeout`` seconds to arrive (a slow client would hold its connection for ever)."""
    from starlette.requests import ClientDisconnect

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
    except ClientDisconnect:
        raise ApiError(CLIENT_LEFT, "the client closed the connection before its body arrived") from None


async def client_left(request) -> None:
    """Returns once the client has closed the connection (its body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer_or_give_up(future: asyncio.Future, left: asyncio.Future, timeout: float) -> list:
    """The request's translations; if they do not come within ``timeout`` or the client leaves (``left``
    is done), the future is cancelled, which takes the request out of the batcher (and stops a batch
    of only it)."""
    done, _ = await asyncio.wait({future, left}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if future in done:
        return future.result()
    future.cancel()
    if left in done:
        raise ApiError(CLIENT_LEFT, "the client closed the connection")  # nobody reads it
    raise ApiError(503, f"no translation within {timeout:g} s; the server is busy")


def batch_budget(translator: Translator, memory: SearchMemory, options: ServeOptions) -> int:
    """The bytes a batch may take. Every request the limits allow must fit one batch: the heaviest
    sentence alone (the longest source the model takes, at --max-beam, reaching --max-output-length,
    with controls at their limits)."""
    longest_source = min(model_positions(translator.model) or math.inf, 4 * options.max_characters + 1)  # UTF-8 bytes
    controls = ControlShape(options.max_output_length, options.max_constraints, options.max_phrase_pieces,
                            options.max_bans, options.max_phrase_pieces)
    needed = memory.batch([options.max_output_length], options.max_beam, longest_source, controls)
    if options.max_batch_memory is None:
        return max(1024 * MIB, needed)
    if needed > options.max_batch_memory * MIB:
        raise NmtError(f"--max-batch-memory {options.max_batch_memory} MiB cannot hold one sentence at --max-beam "
                       f"{options.max_beam} and --max-output-length {options.max_output_length} "
                       f"({math.ceil(needed / MIB)} MiB for this model): raise it or lower those")
    return options.max_batch_memory * MIB


def memory_bound(options: ServeOptions, baseline: int, budget: int, forked: int = 0) -> dict[str, int]:
    """What the server may hold, in MiB: before serving; in each of its ``forked`` worker processes at
    most a copy of that (a fork shares the parent's pages, and can copy only those); one batch per
    worker (the light ones, at least one, and the heavy one); the bodies being read and prepared, the
    answers, the connections' buffers."""
    bodies = options.max_connections * 3 * body_limit(options)  # the bytes read, joined, decoded
    answers = options.max_queue * options.max_beam * (options.max_output_length + 1) * HYPOTHESIS_BYTES_PER_TOKEN
    connections = IDLE_CONNECTIONS_PER_REQUEST * options.max_connections * CONNECTION_BYTES
    parts = {"before_serving": baseline, "workers": forked * baseline, "batches": (max(forked, 1) + 1) * budget,
             "bodies": bodies, "answers": answers, "connections": connections}
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
        "stop": for_default_request(translator.decoding).stop,
        # the search the checkpoint's validation check ran, whose requests take its stop rule; null: none named
        "check": None if translator.decoding.search is None else {"stop": translator.decoding.stop,
                                                                  "search": translator.decoding.search},
        "limits": {"max_sentences": options.max_sentences, "max_characters": options.max_characters,
                   "max_body_bytes": body_limit(options), "max_beam": options.max_beam,
                   "max_bans": options.max_bans, "max_constraints": options.max_constraints,
                   "max_phrase_pieces": options.max_phrase_pieces,
                   "max_output_length": options.max_output_length, "max_queue": options.max_queue,
                   "max_connections": options.max_connections},
        "memory_mib": memory,
        "defaults": {name: getattr(SearchOptions(), name) for name in REQUEST_OPTIONS},
    }


def for_default_request(decoding: DecodingSettings) -> DecodingSettings:
    """What a request with the defaults decodes with (/info's stop and the start-up line), and why: where
    that is not the search the check ran, the options in which the two differ."""
    return for_search(decoding, SearchOptions())


def serve(options: ServeOptions) -> None:
    """Check the options, load the model once, bind, and serve until interrupted."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise NmtError(f"nmt serve needs its optional dependencies: {install_hint('serve')}") from None
    use_threads(options.compute.threads)
    translator = Translator.from_checkpoint(options.path, options.compute.device, options.compute.precision,
                                            options.compute.quantize, options.compute.backend)
    # torch's first call allocates its own buffers: before the memory at start is taken
    translate_ids(translator.model, [np.full(2, EOS_ID)],
                  translator.request(SearchOptions(beam=1, max_len_b=1, stop="exact"), BatchingOptions()))
    baseline = peak_memory()
    decoders = start_decoders(translator)  # before uvicorn starts its threads
    try:
        serve_app(create_app(translator, options, baseline, decoders), translator, options)
    finally:
        for decoder in decoders:
            decoder.close()


def start_decoders(translator: Translator) -> list[ForkedTranslate]:
    """One worker process per torch thread (--threads) for the light batches, forked now, where they can
    be: on Linux (GNU OpenMP and PR_SET_PDEATHSIG), with the model on the CPU, and while no other
    thread runs (one may hold a lock at the fork that the child would wait on forever). The heavy
    requests' thread, beside them, then computes with one thread too."""
    reason = ("not on Linux" if sys.platform != "linux" else
              f"the model is on {translator.device.type}" if translator.device.type != "cpu" else
              "other threads run in this process" if threading.active_count() > 1 else None)
    if reason is not None:
        logger.info("decoding batches on a thread of this process: %s", reason)
        return []
    workers = torch.get_num_threads()
    decoders = fork_decoders(batch_translator(translator), workers)
    torch.set_num_threads(1)
    logger.info("decoding batches in %d forked worker process%s, one thread each", workers,
                "es" if workers > 1 else "")
    return decoders


def serve_app(app, translator: Translator, options: ServeOptions) -> None:
    """Bind, and serve ``app`` until interrupted."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    # the app refuses requests beyond --max-connections (a JSON 503); the protocol closes idle connections
    protocol = with_idle_deadline(AutoHTTPProtocol, options.idle_timeout,
                                  IDLE_CONNECTIONS_PER_REQUEST * options.max_connections)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=protocol,
                            timeout_keep_alive=options.idle_timeout)
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
    server = server_stopping_in_two_steps(uvicorn.Server)(config)
    with server.noting_early_signals():
        logger.info("serving %s on http://%s:%d (POST /translate, GET /health, GET /info); %s", translator.path,
                    shown, port, for_default_request(translator.decoding).describe())
        server.run(sockets=[sock])
    if server.stop_signal:  # uvicorn raised it again after stopping; here when the signal was ignored (nohup, `&`)
        raise Stopped(server.stop_signal)


def server_stopping_in_two_steps(base: type) -> type:
    """uvicorn's server (``base``: uvicorn is imported only when serving), saying what a signal does:
    the first lets the requests in progress be answered, a second ends the process at once and
    quietly (uvicorn's own second Ctrl-C cancels them in the middle: tracebacks, and 500s)."""

    class Server(base):
        early_signals: list[int] = []
        stop_signal = 0  # the first Ctrl-C or SIGTERM
        handlers: dict[int, Any] = {}  # before the early signals were noted

        @contextlib.contextmanager
        def noting_early_signals(self) -> Iterator[None]:
            """Until uvicorn handles them (its capture_signals, where it has one), Ctrl-C and SIGTERM are
            noted, then handled as it starts: one right after the `serving` line interrupted its start
            with tracebacks."""
            if not hasattr(base, "capture_signals") or threading.current_thread() is not threading.main_thread():
                yield
                return
            self.early_signals = []
            self.handlers = {sig: signal.signal(sig, lambda sig, frame: self.early_signals.append(sig))
                             for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in self.handlers.items():
                    signal.signal(sig, handler)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            for sig, handler in self.handlers.items():  # what uvicorn puts back once it has served
                signal.signal(sig, handler)
            with super().capture_signals():
                for sig in self.early_signals:
                    self.handle_exit(sig, None)
                yield

        def handle_exit(self, sig: int, frame: Any) -> None:
            name = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
            if self.should_exit:
                logger.warning("%s: stopped at once, requests in progress unanswered", name)
                os._exit(128 + sig)  # nothing of the user's is being written: the server writes no files
            else:
                self.stop_signal = sig
                logger.warning("%s: stopping once the requests in progress are answered (a second Ctrl-C or "
                               "SIGTERM stops at once)", name)
                super().handle_exit(sig, frame)

    return Server
