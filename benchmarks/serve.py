"""Throughput and latency of `nmt serve` at 1, 8 and 32 concurrent clients, next to offline translation.

    python benchmarks/serve.py [--path CKPT] [--data DIR] [--limit N] [--clients 1,8,32]

Each client sends one sentence per request (the worst case for a server: batching must come from
requests arriving together) and waits for the answer before sending the next; sentences/s is
sentences over the wall time of the whole run, latency is per request. "offline" translates the
same sentences with the same Translator in one call (what `nmt generate` does). Without --path,
a randomly initialised transformer_small stands in (see generate_speed.py: its max length is
capped at |source| + 2 tokens). The clients run in this process, on the same CPU as the server:
on a small machine they take some of its time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
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


def start_server(path: Path, log: Path, threads: int, window_ms: float) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "nmt", "serve", "--path", str(path), "--port", "0", "--log-format", "json",
               "--batch-window-ms", str(window_ms)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, stdout=subprocess.DEVNULL, env=env)
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


def post(port: int, payload: dict) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/translate", body=json.dumps(payload), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status}: {answer}")
        return answer
    finally:
        connection.close()


def batch_count(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())["batches"]
    finally:
        connection.close()


def run_clients(port: int, lines: list[str], clients: int, search: dict) -> tuple[float, list[float]]:
    """Wall seconds for all lines, and each request's latency."""
    next_line = iter(range(len(lines)))
    lock = threading.Lock()
    latencies: list[float] = []

    def client() -> None:
        while True:
            with lock:
                index = next(next_line, None)
            if index is None:
                return
            start = time.perf_counter()
            post(port, {"text": [lines[index]], **search})
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="a trained checkpoint (default: random transformer_small)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with Multi30k's .gz files")
    parser.add_argument("--limit", type=int, default=256, help="translate the first N test sentences (0: all)")
    parser.add_argument("--vocab-size", type=int, default=10000, help="vocabulary of the random model")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--window-ms", type=float, default=5.0, help="the server's --batch-window-ms")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (both sides)")
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
                            f"batch window {args.window_ms:g} ms")
        for column in ("clients", "sentences/s", "of offline", "p50 latency ms", "p95 latency ms", "sentences/batch"):
            table.add_column(column, justify="right")
        table.add_row("offline (one call)", f"{offline:,.1f}", "100%", "", "", "")
        process, port = start_server(Path(path), Path(tmp) / "serve.log", args.threads, args.window_ms)
        try:
            for clients in (int(c) for c in args.clients.split(",")):
                batches_before = batch_count(port)
                seconds, latencies = run_clients(port, lines, clients, search)
                per_batch = len(lines) / (batch_count(port) - batches_before)
                rate = len(lines) / seconds
                p50, p95 = (1000 * float(np.percentile(latencies, q)) for q in (50, 95))
                table.add_row(str(clients), f"{rate:,.1f}", f"{rate / offline:.0%}", f"{p50:,.0f}", f"{p95:,.0f}",
                              f"{per_batch:.1f}")
                Console(stderr=True).print(f"done: {clients} clients")
        finally:
            process.terminate()
            process.wait()
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
