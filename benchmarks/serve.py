"""Throughput and latency of `nmt serve` at 1, 8 and 32 concurrent clients, next to offline translation,
and (--heavy, --abusive) the same load beside a client that keeps sending the heaviest requests, or
one that abuses every field and holds idle sockets.

    python benchmarks/serve.py [--path CKPT] [--data DIR] [--limit N] [--clients 1,8,32] [--heavy] [--abusive]

Each client sends one sentence per request (the worst case for a server: batching must come from
requests arriving together) and waits for the answer before sending the next; sentences/s is
sentences over the wall time of the whole run, latency is per request. "offline" translates the
same sentences with the same Translator in one call (what `nmt generate` does). Without --path,
a randomly initialised transformer_small stands in (see generate_speed.py: its max length is
capped at |source| + 2 tokens). The clients run in this process, on the same CPU as the server:
on a small machine they take some of its time.

With --heavy, each number of clients runs twice, without and with one more client that sends, one
after the other for as long as the others run, the request of issue 30 (64 one-word sentences at
beam 16, max_len_b 512, min_len 100000: refused, 422) and the heaviest one the server's limits let
through (the same at max_len_b = min_len = --max-output-length: every beam decodes to the limit).
Every answer's status is counted, and at the end the server's peak resident memory (VmHWM, summed
over its process and its worker processes) is set against the bound its /info reports.

With --abusive, each number of clients also runs beside a client that holds --max-connections
idle sockets (opened again as the server closes them) and keeps sending, each in a loop of its
own, a request with every control at the server's caps (--max-bans banned phrases and --max-constraints
constraints a sentence of --max-phrase-pieces pieces, a prefix, at --max-beam, every sentence
decoding --max-output-length steps, as many sentences as --max-characters allows) and the
issue's request of controls beyond them (4,000 bans, one of 4,000 words). Meanwhile /health is
asked every 0.2 s: its slowest answer is reported.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_speed import DEFAULT_DATA, random_checkpoint  # noqa: E402

from nmt import Translator  # noqa: E402
from nmt.files import read_lines  # noqa: E402
from nmt.generation.constraints import contains  # noqa: E402

ISSUE_REQUEST = {"text": ["a"] * 64, "beam": 16, "max_len_a": 4, "max_len_b": 512, "min_len": 100_000}


def start_server(path: Path, log: Path, threads: int, window_ms: float,
                 options: list[str]) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "nmt", "serve", "--path", str(path), "--port", "0", "--log-format", "json",
               "--batch-window-ms", str(window_ms), "--threads", str(threads), *options]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, stdout=subprocess.DEVNULL)
    while process.poll() is None:
        for line in log.read_text().splitlines():
            message = json.loads(line)["message"]
            if message.startswith("serving "):
                port = int(message.split("http://127.0.0.1:")[1].split(" ")[0])
                try:
                    post(port, {"text": ["warm-up"]})
                    return process, port
                except ConnectionError:
                    pass
        time.sleep(0.2)
    raise SystemExit(f"the server did not start: {log.read_text()}")


def call(port: int, method: str, path: str, payload: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        body = None if payload is None else json.dumps(payload)
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def post(port: int, payload: dict) -> dict:
    status, answer = call(port, "POST", "/translate", payload)
    if status != 200:
        raise SystemExit(f"HTTP {status}: {answer}")
    return answer


def run_clients(port: int, lines: list[str], clients: int, search: dict
                ) -> tuple[float, list[float], collections.Counter]:
    """Wall seconds for all lines, each request's latency, and the statuses of the answers."""
    next_line = iter(range(len(lines)))
    lock = threading.Lock()
    latencies: list[float] = []
    statuses: collections.Counter = collections.Counter()

    def client() -> None:
        while True:
            with lock:
                index = next(next_line, None)
            if index is None:
                return
            start = time.perf_counter()
            status, _ = call(port, "POST", "/translate", {"text": [lines[index]], **search})
            with lock:
                latencies.append(time.perf_counter() - start)
                statuses[status] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, latencies, statuses


class HeavyClient(threading.Thread):
    """Sends the issue's request and the heaviest allowed one by turns until stopped; counts the answers."""

    def __init__(self, port: int, most_output: int):
        super().__init__()
        self.port, self.stop = port, threading.Event()
        capped = {**ISSUE_REQUEST, "max_len_a": 0, "max_len_b": most_output, "min_len": most_output}
        self.requests = [("issue's", ISSUE_REQUEST), ("heaviest allowed", capped)]
        self.answers: collections.Counter = collections.Counter()
        self.seconds: list[float] = []  # of the heaviest allowed requests answered 200

    def run(self) -> None:
        turn = 0
        while not self.stop.is_set():
            name, payload = self.requests[turn % 2]
            start = time.perf_counter()
            status, answer = call(self.port, "POST", "/translate", payload)
            self.answers[f"{name}: {status}" + (f" ({answer['error'][:40]}...)" if status != 200 else "")] += 1
            if status == 200:
                self.seconds.append(time.perf_counter() - start)
            turn += 1


def capped_phrases(texts: list[str], translator: Translator, pieces: int) -> list[str]:
    """Target phrases of exactly ``pieces`` pieces, cut from ``texts`` (target-side sentences)."""
    target, phrases = translator.vocabs.target, []
    for text in texts:
        ids = target.encode(text)[:pieces]
        phrase = target.decode(ids)
        if len(ids) == pieces and len(target.encode(phrase)) == pieces and phrase.strip():
            phrases.append(phrase)
    return phrases


class AbusiveClient(threading.Thread):
    """Holds idle sockets and keeps sending two requests, each in a loop of its own (so that the quick
    refusals do not wait behind the long searches): one with every control at the caps, and one far
    beyond them."""

    def __init__(self, port: int, info: dict, translator: Translator, sources: list[str], targets: list[str]):
        super().__init__()
        self.port, self.stop = port, threading.Event()
        limits = info["limits"]
        most, phrase_pieces = limits["max_output_length"], limits["max_phrase_pieces"]
        phrases = capped_phrases(targets, translator, phrase_pieces)
        constraints = phrases[:limits["max_constraints"]]
        target = translator.vocabs.target
        bans = [ban for ban in phrases[limits["max_constraints"]:]
                if not any(contains(target.encode(c), target.encode(ban)) for c in constraints)][:limits["max_bans"]]
        prefix = target.decode(target.encode(" ".join(targets))[:most - len(constraints) * phrase_pieces])
        if any(contains(target.encode(prefix), target.encode(ban)) for ban in bans):
            prefix = None
        count = min(limits["max_sentences"], len(sources))
        while True:  # as many sentences as --max-characters allows, text and controls together
            capped = {"text": sources[:count], "beam": limits["max_beam"], "max_len_a": 0, "max_len_b": most,
                      "min_len": most, "ban": bans, "constraints": [constraints] * count, "prefix": [prefix] * count}
            characters = sum(len(s) for s in capped["text"]) + sum(map(len, bans)) + count * (
                sum(map(len, constraints)) + len(prefix or ""))
            if characters <= limits["max_characters"] or count == 1:
                break
            count -= 1
        beyond = {"text": ["a"], "beam": limits["max_beam"], "ban": ["a"] * 3999 + [" ".join(["a b"] * 2000)]}
        self.requests = [(f"at the caps ({count} sentences)", capped), ("beyond the caps", beyond)]
        self.idle = limits["max_connections"]
        self.answers: collections.Counter = collections.Counter()
        self.counting = threading.Lock()  # the two senders count into one Counter

    def run(self) -> None:
        senders = [threading.Thread(target=self.send, args=request) for request in self.requests]
        for sender in senders:
            sender.start()
        sockets: list[socket.socket] = []
        while not self.stop.wait(0.05):
            sockets = [s for s in sockets if not closed(s)]
            sockets += [socket.create_connection(("127.0.0.1", self.port)) for _ in range(self.idle - len(sockets))]
        for sender in senders:
            sender.join()
        for s in sockets:
            s.close()

    def send(self, name: str, payload: dict) -> None:
        """One request in a loop; every answer counted, an unreadable one too (the loop goes on)."""
        while not self.stop.is_set():
            try:
                status, answer = call(self.port, "POST", "/translate", payload)
                outcome = f"{status}" + (f" ({answer['error'][:50]}...)" if status != 200 else "")
            except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
                outcome = f"no JSON answer ({type(exc).__name__})"
            with self.counting:
                self.answers[f"{name}: {outcome}"] += 1


def closed(connection: socket.socket) -> bool:
    """Whether the server has closed an idle socket (it reads as end of file)."""
    connection.setblocking(False)
    try:
        return connection.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        connection.setblocking(True)


class HealthProbe(threading.Thread):
    """Asks /health every 0.2 s until stopped; keeps the slowest answer's seconds."""

    def __init__(self, port: int):
        super().__init__()
        self.port, self.stop, self.slowest = port, threading.Event(), 0.0

    def run(self) -> None:
        while not self.stop.wait(0.2):
            start = time.perf_counter()
            call(self.port, "GET", "/health")
            self.slowest = max(self.slowest, time.perf_counter() - start)


def measure(port: int, server: int, lines: list[str], clients: int, search: dict, offline: float,
            other: threading.Thread | None = None, name: str = "") -> list[str]:
    """One row of the table: the load of ``clients``, beside ``other`` (a heavy or abusive client) if given,
    and where the processor's time went: the server's process, its decoding workers, these clients."""
    batches_before = call(port, "GET", "/health")[1]["batches"]
    cpu_before, clients_before = cpu_seconds(server), time.process_time()
    probe = HealthProbe(port)
    for thread in (other, probe):
        if thread:
            thread.start()
    seconds, latencies, statuses = run_clients(port, lines, clients, search)
    for thread in (other, probe):
        if thread:
            thread.stop.set()
            thread.join()
    server_cpu, workers_cpu = (after - before for after, before in zip(cpu_seconds(server), cpu_before))
    clients_cpu = time.process_time() - clients_before
    per_batch = len(lines) / (call(port, "GET", "/health")[1]["batches"] - batches_before)
    rate = len(lines) / seconds
    p50, p95 = (1000 * float(np.percentile(latencies, q)) for q in (50, 95))
    answers = ", ".join(f"{count} x {status}" for status, count in sorted(statuses.items()))
    other_answers = "" if not other else "; ".join(f"{count} x {what}" for what, count in sorted(other.answers.items()))
    if isinstance(other, HeavyClient) and other.seconds:
        other_answers += f"; {np.mean(other.seconds):.0f} s each"
    return [f"{clients}{f' + {name}' if other else ''}", f"{rate:,.1f}", f"{rate / offline:.0%}", f"{p50:,.0f}",
            f"{p95:,.0f}", f"{per_batch:.1f}", f"{1000 * probe.slowest:,.0f}",
            f"{server_cpu:.1f} / {workers_cpu:.1f} / {clients_cpu:.1f}", answers, other_answers]


def child_processes(pid: int) -> list[int]:
    return [int(child) for tasks in Path(f"/proc/{pid}/task").glob("*/children") for child in tasks.read_text().split()]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """The processor time (user + system) a process has used so far, and its child processes together."""
    def used(process: int) -> float:
        fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return used(pid), sum(map(used, child_processes(pid)))


def peak_rss(pid: int) -> int:
    """The peak resident memory (Linux: VmHWM) of a process and of its child processes (the server's
    forked decoding workers), summed, in bytes. Each counts the pages it shares with the others (the
    model's weights), so the sum overstates what they hold together, as the bound /info gives does."""
    return sum(own_peak_rss(process) for process in [pid, *child_processes(pid)])


def own_peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc: the peak memory needs Linux")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="a trained checkpoint (default: random transformer_small)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with Multi30k's .gz files")
    parser.add_argument("--limit", type=int, default=256, help="translate the first N test sentences (0: all)")
    parser.add_argument("--vocab-size", type=int, default=10000, help="vocabulary of the random model")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--window-ms", type=float, default=5.0, help="the server's --batch-window-ms")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (both sides)")
    parser.add_argument("--heavy", action="store_true", help="each load again beside a client of heavy requests")
    parser.add_argument("--abusive", action="store_true",
                        help="each load again beside a client of requests with controls at and beyond the caps, "
                             "holding idle sockets")
    parser.add_argument("--serve-option", action="append", default=[], metavar="OPTION",
                        help="passed to `nmt serve` (repeat; e.g. --serve-option=--max-batch-memory=256)")
    args = parser.parse_args()
    test_file = args.data / "test_2016_flickr.en.gz"
    if not test_file.exists():
        raise SystemExit(f"Multi30k not found in {args.data} (set --data or NMT_MULTI30K)")
    lines = read_lines(test_file)[: args.limit or None]
    search = dict(max_len_a=1.0, max_len_b=50) if args.path else dict(max_len_a=1.0, max_len_b=2)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or random_checkpoint(args.data, args.vocab_size, Path(tmp))
        translator = Translator.from_checkpoint(path, device="cpu")
        translator.translate(lines[:32], **search)  # warm-up
        start = time.perf_counter()
        translator.translate(lines, **search)
        offline = len(lines) / (time.perf_counter() - start)
        model_name = str(args.path) if args.path else f"random transformer_small, vocab {args.vocab_size}"
        table = Table(title=f"nmt serve, beam 4, {len(lines)} Multi30k test sentences, one per request, "
                            f"{model_name}, {args.threads} torch thread(s), {os.cpu_count()} CPU cores, "
                            f"batch window {args.window_ms:g} ms {' '.join(args.serve_option)}")
        for column in ("clients", "sentences/s", "of offline", "p50 latency ms", "p95 latency ms", "sentences/batch",
                       "slowest /health ms", "CPU s: server / workers / clients", "answers", "other client's answers"):
            table.add_column(column, justify="right")
        table.add_row("offline (one call)", f"{offline:,.1f}", "100%", *[""] * (len(table.columns) - 3))
        process, port = start_server(Path(path), Path(tmp) / "serve.log", args.threads, args.window_ms,
                                     args.serve_option)
        try:
            info = call(port, "GET", "/info")[1]
            targets = read_lines(args.data / "test_2016_flickr.de.gz")
            others = {"": lambda: None}
            if args.heavy:
                others["heavy"] = lambda: HeavyClient(port, info["limits"]["max_output_length"])
            if args.abusive:
                others["abusive"] = lambda: AbusiveClient(port, info, translator, lines, targets)
            for clients in (int(c) for c in args.clients.split(",")):
                for name, other in others.items():
                    table.add_row(*measure(port, process.pid, lines, clients, search, offline, other(), name))
                    Console(stderr=True).print(f"done: {clients} clients{f' and the {name} one' if name else ''}")
            peak = peak_rss(process.pid)
        finally:
            process.terminate()
            process.wait()
    Console(width=200).print(table)
    bound = info["memory_mib"]
    print(f"server peak resident memory (its worker processes' included) {peak / 2 ** 20:,.0f} MiB; "
          f"the bound /info gives {bound['total']:,} MiB "
          f"({', '.join(f'{name} {size:,}' for name, size in bound.items() if name != 'total')})")


if __name__ == "__main__":
    main()
