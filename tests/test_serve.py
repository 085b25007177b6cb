"""`nmt serve`: the real server on a free loopback port, real HTTP requests, no mocks."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("starlette", reason="nmt serve needs the serve extra: pip install -e '.[serve]' in nmt's checkout")
pytest.importorskip("uvicorn", reason="nmt serve needs the serve extra: pip install -e '.[serve]' in nmt's checkout")

from conftest import numbers_pairs  # noqa: E402
from test_translator import tiny_checkpoint  # noqa: E402

from nmt import Translator  # noqa: E402
from nmt.data.vocabulary import Vocabulary  # noqa: E402
from nmt.device import inference_device  # noqa: E402
from nmt.device_options import InferenceDeviceOptions  # noqa: E402
from nmt.generation.generate import generate  # noqa: E402
from nmt.generation.inference import choose_backend  # noqa: E402
from nmt.generation.options import GenerateOptions  # noqa: E402
from nmt.options import build  # noqa: E402
from nmt.serving.options import ServeOptions  # noqa: E402

KEY = "test-key"
LINES = ["five", "Turn to page twelve.", "", "the number four", "My room number is eighty-two.", "seven"]
GIVE_UP = 180  # seconds: only so that a broken build fails instead of hanging


@pytest.fixture(scope="module")
def vocab_for_serving() -> Vocabulary:
    return Vocabulary.train([side for pair in numbers_pairs(300, seed=1) for side in pair], vocab_size=120)


@pytest.fixture(scope="module")
def checkpoint(vocab_for_serving, tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("serve") / "model.pt", vocab_for_serving)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """`nmt serve` in a subprocess on a free port; yields (host, port); checks it is still up at the end."""
    yield from run_server(checkpoint, tmp_path_factory, "--max-sentences", "8", "--max-characters", "400",
                          "--max-queue", "64", "--threads", "2")


class Address(tuple):
    """(host, port) of a running server; ``log`` is its stderr (JSON lines), ``pid`` its process."""
    log: Path
    pid: int


def run_server(checkpoint: Path, tmp_path_factory, *options: str, env: dict[str, str] | None = None):
    log = tmp_path_factory.mktemp("serve-log") / "stderr.jsonl"
    key = [] if env is not None else ["--api-key", KEY]
    command = [sys.executable, "-m", "nmt", "serve", "--path", str(checkpoint), "--port", "0", *key,
               "--log-format", "json", *options]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    try:
        address = Address(wait_until_serving(process, log))
        address.log, address.pid = log, process.pid
        yield address
        assert process.poll() is None, "the server died"
        assert request(address, "GET", "/health")[0] == 200
    finally:
        process.terminate()
        process.wait(GIVE_UP)


def wait_until_serving(process: subprocess.Popen, log: Path) -> tuple[str, int]:
    deadline = time.monotonic() + GIVE_UP
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        for line in log.read_text().splitlines():
            message = json.loads(line)["message"] if line.startswith("{") else line  # `error: ...` is plain
            if message.startswith("serving "):
                port = int(message.split("http://127.0.0.1:")[1].split(" ")[0])
                try:
                    if request(("127.0.0.1", port), "GET", "/health")[0] == 200:
                        return "127.0.0.1", port
                except ConnectionError:
                    pass
        time.sleep(0.2)
    raise AssertionError(f"the server did not start: {log.read_text()}")


def request(address, method: str, path: str, body: bytes | dict | None = None, key: str | None = KEY
            ) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(*address, timeout=GIVE_UP)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict):
        body = json.dumps(body).encode("utf-8")
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def generate_lines(checkpoint: Path, tmp_path: Path, lines: list[str], **options) -> list[str]:
    source, output = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    generate(build(GenerateOptions, {"path": [str(checkpoint)], "input": str(source), "output": str(output),
                                     "print_scores": True, **options}), show_progress=False)
    return output.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.parametrize("options", [{}, {"beam": 2, "lenpen": 1.0, "max_len_b": 5}])
def test_translations_and_scores_equal_generate(server, checkpoint, tmp_path, options):
    status, answer = request(server, "POST", "/translate", {"text": LINES, **options})
    assert status == 200
    served = [f"{score:.4f}\t{text}" for score, text in zip(answer["scores"], answer["translations"])]
    assert served == generate_lines(checkpoint, tmp_path, LINES, **options)


def test_nbest_gives_lists(server):
    status, answer = request(server, "POST", "/translate", {"text": ["five", "seven"], "beam": 3, "nbest": 3})
    assert status == 200 and [len(t) for t in answer["translations"]] == [3, 3]
    assert all(s == sorted(s, reverse=True) for s in answer["scores"])


def test_health_and_info(server):
    status, health = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
    status, info = request(server, "GET", "/info")
    assert status == 200 and info["arch"] == ["transformer_tiny"] and info["vocab"]["source"] == 120
    resolved_precision = inference_device(InferenceDeviceOptions())[1]  # what the server's defaults resolve to here
    assert info["languages"] == {"source": "en", "target": "de"} and info["precision"] == resolved_precision
    assert info["defaults"]["beam"] == 4 and info["limits"]["max_sentences"] == 8
    assert (info["quantize"], info["stop"], info["defaults"]["stop"]) == ("none", "exact", "auto")  # no check recorded
    assert info["check"] is None


def test_info_gives_the_stop_rule_of_a_request_with_the_defaults(checkpoint, tmp_path):
    """A check that searched at --lenpen 1.4 (a recipe's) holds for requests at 1.4 only: /info's
    stop is what a request with the defaults (0.6) gets, exact; a request at 1.4 gets the check's."""
    from nmt.checkpoint.format import load_checkpoint, save_checkpoint
    from nmt.generation.decoding_settings import RECORD_KEY, DecodingSettings
    from nmt.generation.options import SearchOptions
    from nmt.serving.server import for_default_request, server_info

    state = load_checkpoint(checkpoint)
    state[RECORD_KEY] = DecodingSettings("none", "finished", "validation check", SearchOptions(lenpen=1.4).checked()
                                         ).to_dict()
    save_checkpoint(tmp_path / "checked.pt", state)
    translator = Translator.from_checkpoint(tmp_path / "checked.pt", device="cpu")
    info = server_info(translator, ServeOptions(path=str(tmp_path / "checked.pt")), {})
    assert info["stop"] == "exact" and translator.options(lenpen=1.4)[0].stop == "finished"
    assert info["check"] == {"stop": "finished", "search": SearchOptions(lenpen=1.4).checked()}  # what a client sends
    # the `serving ...` line says the same, and where finished holds
    logged = for_default_request(translator.decoding).describe()
    assert logged.startswith("quantize none, stop exact (") and \
        "; stop exact: this search has --lenpen 0.6 (the check's: 1.4); with the check's, stop finished" in logged


FORKED = "decoding batches in 2 forked worker processes, one thread each"
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the server forks its workers on Linux")


def log_messages(address) -> list[str]:
    return [json.loads(line)["message"] for line in address.log.read_text(encoding="utf-8").splitlines()
            if line.startswith("{")]


def worker_processes(pid: int) -> list[int]:
    """A server's child processes: its forked decoding workers."""
    return [int(child) for tasks in Path(f"/proc/{pid}/task").glob("*/children") for child in tasks.read_text().split()]


def cpu_ticks(pid: int) -> int:
    """The CPU time a process has taken (user and system), in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@linux_only
def test_with_two_threads_batches_are_decoded_in_two_forked_worker_processes(server):
    """The translations are those of `nmt generate` (the tests above, on this server): here, who decodes them."""
    assert FORKED in log_messages(server)
    workers = worker_processes(server.pid)
    assert len(workers) == 2
    before = sum(map(cpu_ticks, workers))
    long = {"text": [f"number {i}" for i in range(8)], "max_len_a": 0, "max_len_b": 100, "min_len": 100}
    assert request(server, "POST", "/translate", long)[0] == 200
    assert sum(map(cpu_ticks, workers)) - before >= 5  # 50 ms at least, of 3,200 decoder steps


@linux_only
def test_the_memory_bound_counts_each_worker_process_and_its_batch(server):
    """Two light workers and the heavy one: three batches of the default budget; each forked worker may
    come to hold a copy of every page the server held before serving."""
    memory = request(server, "GET", "/info")[1]["memory_mib"]
    assert memory["batches"] == 3 * 1024
    assert 2 * memory["before_serving"] - 1 <= memory["workers"] <= 2 * memory["before_serving"]
    assert memory["total"] >= sum(size for name, size in memory.items() if name != "total") - len(memory)


def test_32_concurrent_clients_get_their_own_answers(server, checkpoint):
    sentences = [source for source, _ in numbers_pairs(64, seed=7)]
    expected = Translator.from_checkpoint(checkpoint, device="cpu").translate(sentences, max_len_b=10)
    batches_before = request(server, "GET", "/health")[1]["batches"]

    def client(i: int) -> tuple[int, dict]:
        return request(server, "POST", "/translate", {"text": sentences[2 * i:2 * i + 2], "max_len_b": 10})

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(client, range(32)))
    assert [status for status, _ in answers] == [200] * 32
    assert [t for _, answer in answers for t in answer["translations"]] == expected
    batches = request(server, "GET", "/health")[1]["batches"] - batches_before
    assert batches < 32  # requests that arrived together were translated together


@pytest.mark.skipif(not choose_backend(torch.device("cpu"), "int8").describe().startswith("nmt's C kernels"),
                    reason="to the bit with nmt's kernels only: torch's float operations may sum padded batches "
                           "in another order")
def test_int8_answers_do_not_depend_on_what_other_clients_sent(checkpoint, tmp_path_factory):
    """int8 quantizes each row with a scale of its own: a sentence served in batches with 31 other
    clients' gets the translation and score, to the bit, that it gets offline alone (a scale per
    batch, as fbgemm's, changed 139 of the 1,000 Multi30k test answers)."""
    sentences = [source for source, _ in numbers_pairs(64, seed=11)]
    with Translator.from_checkpoint(checkpoint, device="cpu", quantize="int8") as translator:
        alone = [translator.hypotheses([sentence], max_len_b=10)[0][0] for sentence in sentences]
    for address in run_server(checkpoint, tmp_path_factory, "--quantize", "int8", "--threads", "2"):
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda i: request(address, "POST", "/translate",
                                                      {"text": sentences[2 * i:2 * i + 2], "max_len_b": 10}),
                                    range(32)))
        assert any("quantize int8" in message for message in log_messages(address))
        assert request(address, "GET", "/health")[1]["batches"] < 32  # requests translated together
    assert [status for status, _ in answers] == [200] * 32
    assert [text for _, answer in answers for text in answer["translations"]] == [h.text for h in alone]
    assert [score for _, answer in answers for score in answer["scores"]] == [h.score for h in alone]


@pytest.mark.parametrize("body,status,message", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"text": ["f\xff"]}', 400, "not valid UTF-8"),
    (b'["five"]', 400, "must be a JSON object"),
    (b"{}", 422, '"text" must be a non-empty list of strings'),
    (b'{"text": []}', 422, '"text" must be a non-empty list of strings'),
    (b'{"text": "five"}', 422, '"text" must be a non-empty list of strings'),
    (b'{"text": ["five", 5]}', 422, '"text" must be a non-empty list of strings'),
    (b'{"text": ["five", "\\ud800"]}', 422, '"text" sentence 2 holds a lone surrogate escape'),
    (b'{"text": ["five"], "beam": "4"}', 422, '"beam" must be an integer, got a string'),
    (b'{"text": ["five"], "beam": true}', 422, '"beam" must be an integer, got a boolean'),
    (b'{"text": ["five"], "lenpen": NaN}', 422, '"lenpen" must be a finite number, got NaN'),
    (b'{"text": ["five"], "lenpen": -Infinity}', 422, '"lenpen" must be a finite number, got -Infinity'),
    (b'{"text": ["five"], "beam": 17}', 422, '"beam" must be at most 16'),
    (b'{"text": ["five"], "max_len_b": 100000}', 422, '"max_len_b" must be at most'),
    # The request: 1,024 rows for 516 steps. What a request may reach is capped (--max-output-length).
    (json.dumps({"text": ["a"] * 8, "beam": 16, "max_len_a": 4, "max_len_b": 512, "min_len": 100000}).encode(), 422,
     "\"max_len_b\" must be at most 256 (the server's --max-output-length)"),
    (b'{"text": ["five"], "min_len": 100000}', 422,
     "\"min_len\" must be at most 256 (the server's --max-output-length)"),
    (b'{"text": ["five"], "no_repeat_ngram_size": 257}', 422, '"no_repeat_ngram_size" must be at most 256'),
    (b'{"text": ["five"], "max_len_a": 4.5}', 422, '"max_len_a" must be at most 4'),
    (json.dumps({"text": ["five " * 15], "max_len_a": 4, "max_len_b": 50}).encode(), 422,
     "text 1 may reach 290 output tokens (max_len_a 4 x its 60 tokens + max_len_b 50); the server's "
     "--max-output-length is 256: lower max_len_a or max_len_b"),
    # Python's json fails on these with a RecursionError and a ValueError, not a JSONDecodeError.
    (b'{"text": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400, "the body is not valid JSON here: it nests too deeply"),
    (b'{"text": ["five"], "beam": ' + b"4" * 5000 + b"}", 400,
     "the body is not valid JSON here: Exceeds the limit (4300 digits) for integer string conversion"),
    (b'{"text": ["five"], "beam": 0}', 422, '"beam" must be at least 1'),
    (b'{"text": ["five"], "beam": 2, "nbest": 3}', 422, '"nbest" must be between 1 and "beam"'),
    (b'{"text": ["five"], "lenpen_style": "x"}', 422, "lenpen_style must be one of gnmt, fairseq"),
    (b'{"text": ["five"], "stop": "soon"}', 422, "stop must be one of auto, exact, current, finished"),
    (b'{"text": ["five"], "sampling": true}', 422, "unknown field(s) sampling"),
    (json.dumps({"text": ["five"] * 9}).encode(), 413, "9 sentences in one request; at most 8"),
    (json.dumps({"text": ["five " * 100]}).encode(), 413, "500 characters in one request; at most 400"),
    (b"x" * 2_000_000, 413, "the body has"),
])
def test_bad_requests_get_their_status_and_one_line(server, body, status, message):
    got, answer = request(server, "POST", "/translate", body)
    assert (got, list(answer)) == (status, ["error"])
    assert message in answer["error"] and "\n" not in answer["error"]


def test_wrong_method_path_and_key(server):
    assert request(server, "GET", "/translate") == (405, {"error": "Method Not Allowed"})
    assert request(server, "GET", "/nope") == (404, {"error": "Not Found"})
    for key in (None, "wrong"):
        for method, path, body in (("GET", "/health", None), ("GET", "/info", None),
                                   ("POST", "/translate", {"text": ["five"]})):
            status, answer = request(server, method, path, body, key=key)
            assert status == 401 and "API key" in answer["error"]


def test_the_bearer_scheme_is_case_insensitive(server):
    for scheme in ("Bearer", "bearer", "BEARER"):
        connection = http.client.HTTPConnection(*server, timeout=GIVE_UP)
        try:
            connection.request("GET", "/health", headers={"Authorization": f"{scheme} {KEY}"})
            assert connection.getresponse().status == 200, scheme
        finally:
            connection.close()


def test_a_full_queue_answers_429_and_the_rest_are_served(server):
    # Each request keeps the worker busy for 120 decoder steps; 12 x 8 sentences > the queue's 64.
    long = {"text": [f"number {i}" for i in range(8)], "beam": 4, "min_len": 120, "max_len_b": 120}
    with ThreadPoolExecutor(12) as pool:
        statuses = [status for status, _ in pool.map(lambda _: request(server, "POST", "/translate", long), range(12))]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 8
    assert request(server, "GET", "/health")[1]["waiting_sentences"] == 0


def test_a_request_not_answered_in_time_gets_503(checkpoint, tmp_path_factory):
    # The batch window alone (50 ms) outlasts the 1 ms timeout: no request can be answered in time.
    for address in run_server(checkpoint, tmp_path_factory, "--request-timeout", "0.001", "--batch-window-ms", "50"):
        status, answer = request(address, "POST", "/translate", {"text": ["five"]})
        assert status == 503 and answer["error"] == "no translation within 0.001 s; the server is busy"


def serve_command(checkpoint: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "nmt", "serve", "--path", str(checkpoint), *args]


def test_binding_beyond_loopback_needs_an_api_key(checkpoint):
    result = subprocess.run(serve_command(checkpoint, "--host", "0.0.0.0"), capture_output=True, text=True,
                            timeout=GIVE_UP)
    assert result.returncode == 1
    assert result.stderr == ("error: binding to 0.0.0.0 exposes the server beyond this machine: give --api-key KEY "
                             "(or set NMT_API_KEY)\n")


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_from_the_option_and_the_environment(checkpoint, key):
    """The option parser reads "" as "not given" elsewhere: here the server would start without a key."""
    for args, env in (((("--api-key", key)), {}), ((), {"NMT_API_KEY": key})):
        result = subprocess.run(serve_command(checkpoint, *args), capture_output=True, text=True, timeout=GIVE_UP,
                                env={**os.environ, **env})
        assert result.returncode == 1
        assert result.stderr == "error: the API key is empty (--api-key or NMT_API_KEY): give a key, or none\n"


def test_an_api_key_is_taken_as_written():
    assert build(ServeOptions, {"api_key": "none"}).api_key == "none"  # not the option left out


def test_without_the_extra_the_error_says_what_to_install(checkpoint):
    code = ("import sys; sys.modules['uvicorn'] = None; from nmt.cli import main; "
            f"sys.argv = ['nmt', 'serve', '--path', {str(checkpoint)!r}]; main()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GIVE_UP)
    assert result.returncode == 1
    assert result.stderr == ("error: nmt serve needs its optional dependencies: pip install -e '.[serve]' in nmt's "
                             "checkout\n")


def test_a_sentence_too_long_for_the_model_is_refused_alone(vocab_for_serving, tmp_path_factory):
    """Checked per request (422 with the reason), so it never fails the requests batched with it."""
    short = tiny_checkpoint(tmp_path_factory.mktemp("short") / "model.pt", vocab_for_serving, max_positions=24)
    for address in run_server(short, tmp_path_factory, "--batch-window-ms", "200"):
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(request, address, "POST", "/translate", {"text": ["five " * 40]})
            time.sleep(0.05)  # inside the first request's batch window
            fine = pool.submit(request, address, "POST", "/translate", {"text": ["five"], "max_len_b": 5})
            (status, answer), (fine_status, _) = long.result(), fine.result()
        assert status == 422 and re.match(r"text 1 has \d+ tokens \(EOS included\), over the model's max_positions 24",
                                          answer["error"]), answer
        assert fine_status == 200


def test_a_queue_smaller_than_a_request_is_refused_at_start(checkpoint):
    result = subprocess.run(serve_command(checkpoint, "--max-queue", "2", "--max-sentences", "3"), capture_output=True,
                            text=True, timeout=GIVE_UP)
    assert result.returncode == 1 and result.stderr == ("error: --max-queue 2 is below --max-sentences 3: a full "
                                                         "request would always be refused (429)\n")


def health(address) -> dict:
    return request(address, "GET", "/health")[1]


def wait_until_idle(address) -> dict:
    """/health once no sentence is waiting or being translated."""
    deadline = time.monotonic() + GIVE_UP
    while (answer := health(address))["waiting_sentences"]:
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)
    return answer


def test_bad_json_leaves_no_traceback_in_the_log(server):
    for body in (b'{"text": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", b'{"beam": ' + b"4" * 5000 + b"}"):
        assert request(server, "POST", "/translate", body)[0] == 400
    log = server.log.read_text(encoding="utf-8")
    assert "Traceback" not in log and "failed" not in log


HEAVY = {"beam": 16, "max_len_a": 0, "max_len_b": 200, "min_len": 200}  # every beam runs its 200 steps


def test_a_heavy_request_is_translated_in_batches_that_fit_the_memory_budget(checkpoint, tmp_path_factory):
    """Batches are sized by rows x the longest output they may reach: a budget of 2.5 heavy sentences
    gives 8 of them in 4 batches, and they come out as a batch of all 8 would have them."""
    from nmt.serving.budget import SearchMemory

    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    sentences = [f"number {i}" for i in range(8)]
    lengths = {len(source) for source in translator.vocabs.source.encode_batch(sentences)}
    assert len(lengths) == 1  # one length: the batch's memory is the sum of its sentences'
    memory = SearchMemory(translator.model, translator.precision, translator.device.type)
    one = memory.batch([HEAVY["max_len_b"]], HEAVY["beam"], lengths.pop() + 1)
    budget_mib = math.ceil(2.5 * one / 2 ** 20)
    per_batch = budget_mib * 2 ** 20 // one
    assert per_batch in (2, 3)
    expected = translator.translate(sentences, **HEAVY)
    for address in run_server(checkpoint, tmp_path_factory, "--max-batch-memory", str(budget_mib),
                              "--max-output-length", "200", "--max-characters", "80",
                              "--max-constraints", "0", "--max-bans", "0"):  # no room for controls' memory
        status, answer = request(address, "POST", "/translate", {"text": sentences, **HEAVY})
        assert status == 200 and answer["translations"] == expected
        assert health(address)["batches"] == math.ceil(8 / per_batch)


def test_a_budget_that_cannot_hold_one_sentence_is_refused_at_start(checkpoint):
    result = subprocess.run(serve_command(checkpoint, "--max-batch-memory", "1", "--max-output-length", "256",
                                          "--quiet"), capture_output=True, text=True, timeout=GIVE_UP)  # no info lines
    assert result.returncode == 1 and re.fullmatch(
        r"error: --max-batch-memory 1 MiB cannot hold one sentence at --max-beam 16 and --max-output-length 256 "
        r"\(\d+ MiB for this model\): raise it or lower those\n", result.stderr), result.stderr


LONG = {"text": [f"number {i}" for i in range(8)], "beam": 16, "max_len_a": 0, "max_len_b": 1000, "min_len": 1000}


LONG_LIGHT = {**LONG, "beam": 4}  # 4 x 1,000 steps: a light request (at most a quarter of 16 x 1,000)


def test_a_request_that_timed_out_stops_its_batch(checkpoint, tmp_path_factory):
    """1,000 steps of 128 rows (on the heavy requests' thread), or of 32 (a light request: in a worker
    process on Linux), outlast the 0.3 s timeout: the search stops (its sentences are abandoned, none
    translated) instead of decoding to the end."""
    for address in run_server(checkpoint, tmp_path_factory, "--request-timeout", "0.3", "--max-output-length",
                              "1000", "--max-sentences", "8", "--threads", "2"):
        assert sys.platform != "linux" or FORKED in log_messages(address)
        for body in (LONG, LONG_LIGHT):
            before = health(address)
            status, answer = request(address, "POST", "/translate", body)
            assert status == 503 and answer["error"] == "no translation within 0.3 s; the server is busy"
            after = wait_until_idle(address)
            assert after["abandoned_sentences"] - before["abandoned_sentences"] == 8
            assert after["sentences"] == before["sentences"]


def test_a_client_that_leaves_takes_its_request_out_and_the_next_one_is_served(checkpoint, tmp_path_factory):
    """The heavy request on the heavy requests' thread, the light one in a worker process (on Linux)."""
    for address in run_server(checkpoint, tmp_path_factory, "--max-output-length", "1000", "--max-sentences", "8",
                              "--threads", "2"):
        workers = worker_processes(address.pid) if sys.platform == "linux" else []
        assert sys.platform != "linux" or FORKED in log_messages(address)
        for body, decoders in ((LONG, []), (LONG_LIGHT, workers)):
            before, idle = health(address), sum(map(cpu_ticks, decoders))
            payload = json.dumps(body).encode()
            with socket.create_connection(address, timeout=GIVE_UP) as client:
                client.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " +
                               str(len(payload)).encode() + b"\r\n\r\n" + payload)
                while health(address)["waiting_sentences"] == 0:  # until the server has the request
                    time.sleep(0.01)
                while decoders and sum(map(cpu_ticks, decoders)) - idle < 3:  # until a worker decodes it
                    time.sleep(0.01)
            after = wait_until_idle(address)
            assert after["abandoned_sentences"] - before["abandoned_sentences"] == 8
            assert after["sentences"] == before["sentences"]
            assert request(address, "POST", "/translate", {"text": ["five"]})[0] == 200


def wait_until_ended(pid: int) -> None:
    """Until a killed process is a zombie (its parent has not yet waited for it) or gone."""
    deadline = time.monotonic() + GIVE_UP
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


@linux_only
def test_a_killed_worker_process_fails_only_its_batch_and_the_others_take_the_next(checkpoint, tmp_path_factory):
    """One worker killed while idle: every request is still answered, by the other. The other killed
    while it decodes a request: that request gets a one-line 500, and a thread of the server takes
    the next ones. Each death is logged once, without a traceback."""
    import signal

    for address in run_server(checkpoint, tmp_path_factory, "--threads", "2", "--max-sentences", "8"):
        first, second = worker_processes(address.pid)
        os.kill(first, signal.SIGKILL)
        wait_until_ended(first)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: request(address, "POST", "/translate", {"text": [f"number {i}"]}),
                                    range(8)))
        assert [status for status, _ in answers] == [200] * 8
        long = {"text": [f"number {i}" for i in range(8)], "max_len_a": 0, "max_len_b": 256, "min_len": 256}
        with ThreadPoolExecutor(1) as pool:
            idle = cpu_ticks(second)
            answer = pool.submit(request, address, "POST", "/translate", long)
            while cpu_ticks(second) - idle < 3:  # until it decodes the request
                assert not answer.done(), answer.result()
                time.sleep(0.01)
            os.kill(second, signal.SIGKILL)
            status, error = answer.result()
        assert status == 500 and list(error) == ["error"] and "\n" not in error["error"]
        assert error["error"].startswith("the decoding worker process that had this request ended")
        assert str(second) not in error["error"]  # the process and how it ended are the log's, not a client's
        assert request(address, "POST", "/translate", {"text": ["five", "seven"]})[0] == 200
        assert worker_processes(address.pid) == []
        warnings = [message for message in log_messages(address) if message.startswith("decoding worker process")]
        assert len(warnings) == 2 and warnings[-1].endswith("a thread of this process takes the next batches")
        assert warnings[-1].startswith(f"decoding worker process {second} ended (killed by SIGKILL")
        assert "Traceback" not in address.log.read_text(encoding="utf-8")


@linux_only
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_to_every_process_of_the_server_lets_its_workers_answer_the_requests_in_progress(
        checkpoint, tmp_path, name):
    """systemd stops a service with SIGTERM to each of its processes, and a terminal's Ctrl-C reaches
    the whole process group: the worker processes go on decoding the request in progress, which is
    answered, and the server ends them once it has stopped."""
    import signal

    signum = getattr(signal, name)
    log = tmp_path / "stderr.jsonl"
    command = serve_command(checkpoint, "--port", "0", "--api-key", KEY, "--log-format", "json", "--threads", "2",
                            "--max-sentences", "8", "--request-timeout", "600")
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        address = Address(wait_until_serving(process, log))
        address.log = log
        workers = worker_processes(process.pid)
        assert len(workers) == 2
        with ThreadPoolExecutor(1) as pool:
            idle = sum(map(cpu_ticks, workers))
            long = {"text": [f"number {i}" for i in range(8)], "max_len_a": 0, "max_len_b": 256, "min_len": 256}
            answer = pool.submit(request, address, "POST", "/translate", long)
            while sum(map(cpu_ticks, workers)) - idle < 3:  # until a worker decodes it
                assert not answer.done(), answer.result()
                time.sleep(0.01)
            os.killpg(process.pid, signum)
            status, body = answer.result()
        assert status == 200 and len(body["translations"]) == 8, body
        assert process.wait(GIVE_UP) in (128 + signum, -signum)  # SIGTERM: raised again once stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(GIVE_UP)
    text = log.read_text(encoding="utf-8")
    assert "decoding worker process" not in text and "Traceback" not in text, text
    for worker in workers:
        wait_until_ended(worker)


def test_the_api_key_may_come_from_the_environment(checkpoint, tmp_path_factory):
    """NMT_API_KEY, as --help and the docs say (a command line is visible to every user in ps)."""
    for address in run_server(checkpoint, tmp_path_factory, env={"NMT_API_KEY": KEY}):
        assert request(address, "POST", "/translate", {"text": ["five"]}, key=None)[0] == 401
        assert request(address, "POST", "/translate", {"text": ["five"]}, key="wrong")[0] == 401
        assert request(address, "POST", "/translate", {"text": ["five"]})[0] == 200


def test_a_body_that_does_not_arrive_in_time_gets_408(checkpoint, tmp_path_factory):
    for address in run_server(checkpoint, tmp_path_factory, "--body-timeout", "0.5"):
        with socket.create_connection(address, timeout=GIVE_UP) as client:
            client.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"text\"")
            response = client.makefile("rb").read()  # the server answers, then closes the connection
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body) == {"error": "the body did not arrive within 0.5 s"}
        assert request(address, "POST", "/translate", {"text": ["five"]})[0] == 200


def raw_request(address, method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, dict]:
    """A request with exactly these headers (``Content_Type`` is sent as Content-Type), and its JSON answer."""
    connection = http.client.HTTPConnection(*address, timeout=GIVE_UP)
    try:
        connection.request(method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


HEAD = (b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Bearer " +
        KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n")


def test_requests_beyond_max_connections_get_a_json_503_and_health_still_answers(checkpoint, tmp_path_factory):
    for address in run_server(checkpoint, tmp_path_factory, "--max-connections", "1", "--body-timeout", "60"):
        with socket.create_connection(address, timeout=GIVE_UP) as slow:
            slow.sendall(HEAD + b'{"text"')  # a request whose body is still coming
            deadline = time.monotonic() + GIVE_UP
            while (answer := request(address, "POST", "/translate", {"text": ["five"]}))[0] == 200:
                assert time.monotonic() < deadline  # until the server has the slow request
                time.sleep(0.05)
            assert answer == (503, {"error": "1 requests are being handled (the server's --max-connections); "
                                              "retry later"})
            assert request(address, "GET", "/health")[0] == 200


def test_idle_connections_are_closed_and_never_refuse_a_request(checkpoint, tmp_path_factory):
    """uvicorn waited for ever for a first request: idle sockets held the connection limit (503 for all)."""
    for address in run_server(checkpoint, tmp_path_factory, "--max-connections", "2", "--idle-timeout", "2"):
        opened = time.monotonic()
        idle = [socket.create_connection(address, timeout=10) for _ in range(2)]
        trickled = socket.create_connection(address, timeout=10)
        for byte in HEAD[:10]:  # a head a byte at a time: each byte used to reset uvicorn's keep-alive timer
            trickled.sendall(bytes([byte]))
            time.sleep(0.1)
        assert request(address, "POST", "/translate", {"text": ["five"]})[0] == 200
        for client in idle + [trickled]:
            assert client.recv(1) == b""  # closed by the server
            client.close()
        assert 2 <= time.monotonic() - opened < 9
        crowd = [socket.create_connection(address, timeout=10) for _ in range(9)]  # 4 x --max-connections, and one
        start = time.monotonic()
        assert crowd[0].recv(1) == b"" and time.monotonic() - start < 1.5  # the oldest idle one, closed at once
        assert request(address, "POST", "/translate", {"text": ["five"]})[0] == 200  # the crowd locks no one out
        for client in crowd:
            client.close()
        time.sleep(0.2)  # the server sees them close
        assert request(address, "GET", "/health")[0] == 200


def test_a_client_that_leaves_while_sending_its_body_leaves_no_traceback(server):
    for _ in range(3):
        with socket.create_connection(server, timeout=GIVE_UP) as client:
            client.sendall(HEAD + b'{"text"')
            time.sleep(0.2)
    time.sleep(1)  # the server sees the connections close
    assert request(server, "GET", "/health")[0] == 200
    log = server.log.read_text(encoding="utf-8")
    assert "Traceback" not in log and "failed" not in log, log


async def call_app(app, receive, method: str = "POST", path: str = "/translate") -> tuple[int, dict]:
    """One request to the ASGI app in this process, its messages from ``receive``: the status the app sends
    and its JSON answer (what a client that left over HTTP never sees)."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}
    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(message.get("body", b"") for message in sent[1:]))


def test_a_client_that_leaves_while_sending_its_body_gets_499_and_nothing_is_logged(checkpoint):
    """The test above cannot see the status (its client has gone): here the app is called in-process with a
    disconnect in the middle of the body, which used to end in the generic handler (a traceback and a 500)."""
    from conftest import logged_messages

    from nmt.serving.server import create_app

    app = create_app(Translator.from_checkpoint(checkpoint), ServeOptions(path=str(checkpoint)))
    parts = iter([{"type": "http.request", "body": b'{"text"', "more_body": True}, {"type": "http.disconnect"}])

    async def receive() -> dict:
        return next(parts)

    with logged_messages() as logged:
        answer = asyncio.run(call_app(app, receive))
    assert answer == (499, {"error": "the client closed the connection before its body arrived"})
    assert logged == []


def test_a_body_not_declared_as_json_gets_415(server):
    """A web page may POST text/plain (or a form) without a CORS preflight; JSON needs one."""
    body = json.dumps({"text": ["five"]}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        status, answer = raw_request(server, "POST", "/translate", body, Authorization=f"Bearer {KEY}",
                                     **({"Content_Type": content_type} if content_type else {}))
        assert status == 415 and answer["error"].startswith("send the body as Content-Type: application/json"), answer
    assert raw_request(server, "POST", "/translate", body, Authorization=f"Bearer {KEY}",
                       Content_Type="Application/JSON; charset=utf-8")[0] == 200


def test_requests_from_a_web_page_of_another_origin_are_refused(server):
    body = json.dumps({"text": ["five"]}).encode()
    own = f"http://127.0.0.1:{server[1]}"
    for origin in ("http://attacker.test", "null", "http://127.0.0.1:1", f"{own}.attacker.test"):
        for method, path, payload in (("POST", "/translate", body), ("GET", "/info", None)):
            status, answer = raw_request(server, method, path, payload, Authorization=f"Bearer {KEY}",
                                         Content_Type="application/json", Origin=origin)
            assert status == 403 and "another origin" in answer["error"], (origin, answer)
    assert raw_request(server, "POST", "/translate", body, Authorization=f"Bearer {KEY}",
                       Content_Type="application/json", Origin=own)[0] == 200


def test_without_a_key_only_requests_to_a_loopback_name_are_answered(checkpoint, tmp_path_factory):
    """DNS rebinding: a page of attacker.test, its name pointed at 127.0.0.1, is its own origin."""
    body = json.dumps({"text": ["five"]}).encode()
    for address in run_server(checkpoint, tmp_path_factory, env={}):
        port = address[1]
        status, answer = raw_request(address, "POST", "/translate", body, Content_Type="text/plain",
                                     Origin=f"http://attacker.test:{port}", Host=f"attacker.test:{port}")  # the issue's
        assert status == 403 and "is not a loopback name" in answer["error"]
        for method, path, payload in (("GET", "/info", None), ("GET", "/health", None), ("POST", "/translate", body)):
            status, _ = raw_request(address, method, path, payload, Content_Type="application/json",
                                    Host=f"attacker.test:{port}", Origin=f"http://attacker.test:{port}")
            assert status == 403
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
            assert raw_request(address, "POST", "/translate", body, Content_Type="application/json", Host=host,
                               Origin=f"http://{host}")[0] == 200, host


def test_the_body_limit_is_the_one_the_docs_give(server):
    """docs/serving.md: a body over 12 x --max-characters + 64 KiB is refused before it is read."""
    from nmt.serving.request import BODY_BYTES_PER_CHARACTER, BODY_SLACK

    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    per_character, slack_kib = map(int,
                                   re.search(r"a body over (\d+) x `--max-characters` \+ (\d+) KiB", docs).groups())
    assert (per_character, slack_kib * 1024) == (BODY_BYTES_PER_CHARACTER, BODY_SLACK)
    limit = request(server, "GET", "/info")[1]["limits"]["max_body_bytes"]
    assert limit == 400 * per_character + slack_kib * 1024  # the module's server: --max-characters 400
    padded = b'{"text": ["five"]' + b" " * (limit - 18) + b"}"
    assert len(padded) == limit and request(server, "POST", "/translate", padded)[0] == 200
    assert request(server, "POST", "/translate", padded + b" ")[0] == 413


def test_the_logged_address_already_accepts_connections(checkpoint, monkeypatch):
    """A client that reads the `serving ... on http://HOST:PORT` line (how --port 0 tells the port)
    may connect at once: the socket listens before the line is written."""
    import uvicorn

    import nmt.serving.server as server_module

    connected = []

    def connect_at_log_time(message, *args):
        if message.startswith("serving "):
            port = args[2]
            with socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP):
                connected.append(port)

    monkeypatch.setattr(server_module.logger, "info", connect_at_log_time)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: sockets[0].close())
    server_module.serve(build(ServeOptions, {"path": str(checkpoint), "port": "0"}))
    assert len(connected) == 1


def test_a_first_signal_lets_requests_finish_and_a_second_ends_at_once_without_tracebacks(monkeypatch, messages):
    import signal

    from nmt.serving.server import server_stopping_in_two_steps

    class UvicornServer:  # what uvicorn's does with a signal, as far as it matters here
        should_exit = False

        def handle_exit(self, sig, frame):
            self.should_exit = True

    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    server = server_stopping_in_two_steps(UvicornServer)()
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and exits == []
    server.handle_exit(signal.SIGTERM, None)
    assert exits == [143]
    assert messages == ["Ctrl-C: stopping once the requests in progress are answered (a second Ctrl-C or SIGTERM "
                        "stops at once)", "SIGTERM: stopped at once, requests in progress unanswered"]


def test_option_errors_name_the_request_fields_whole_flags_only():
    from nmt.serving.request import in_request_terms

    assert in_request_terms("--lenpen-style x; --lenpen 1; --nbest must be between 1 and --beam; --max-beam 16") == \
        '"lenpen_style" x; "lenpen" 1; "nbest" must be between 1 and "beam"; --max-beam 16'


def wait_for_serving_line(process: subprocess.Popen, log: Path) -> None:
    """Until the server's plain-text log says `serving ...` (its last line before uvicorn starts)."""
    deadline = time.monotonic() + GIVE_UP
    while "serving " not in log.read_text() and time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        time.sleep(0.05)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_the_server_with_its_line_and_130(checkpoint, tmp_path, inherited):
    """Through uvicorn's own signal handling, which the two-step server hooks into; also when the
    server starts with Ctrl-C ignored, as a shell's background job (`&`, nohup) does."""
    import signal

    def ignore_ctrl_c() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        process = subprocess.Popen(serve_command(checkpoint, "--port", "0"), stderr=stderr, stdout=subprocess.DEVNULL,
                                   preexec_fn=ignore_ctrl_c if inherited == "ignored" else None)
    try:
        wait_for_serving_line(process, log)
        process.send_signal(signal.SIGINT)
        assert process.wait(GIVE_UP) == 130, log.read_text()
    finally:
        process.kill()
    text = log.read_text()
    assert "Ctrl-C: stopping once the requests in progress are answered" in text and "Traceback" not in text
    assert text.endswith("interrupted\n")


def test_a_batch_is_searched_whole_on_one_thread(checkpoint, monkeypatch):
    """Cut into one part per torch thread on Python threads, a batch served fewer sentences a second
    (benchmarks/notes/amd-epyc-zen4-2026-11-28.md): whole, with torch's threads inside its operations."""
    import threading

    import torch

    import nmt.generation.inference as inference
    from nmt.generation.inference import encode_sources
    from nmt.generation.options import BatchingOptions
    from nmt.serving.server import batch_translator

    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    searched, search = [], inference.beam_search

    def recorded(*args, **kwargs):
        searched.append(threading.get_ident())
        return search(*args, **kwargs)

    monkeypatch.setattr(inference, "beam_search", recorded)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    sources = encode_sources(translator.vocabs, [f"number {i}" for i in range(8)])
    search_options, _ = translator.options(max_len_b=5)
    hypotheses = batch_translator(translator)(sources, search_options, None, lambda: False)
    assert [h[0].tokens for h in hypotheses] == [h[0].tokens for h in inference.translate_ids(
        translator.model, sources, translator.request(search_options, BatchingOptions(workers=1)))]
    assert searched[0] == threading.get_ident() and len(searched) == 2  # one search for the batch, one here


def test_a_ctrl_c_right_after_the_serving_line_stops_the_server_in_two_steps_too(checkpoint, tmp_path):
    """uvicorn handles signals once started: one between the line and that (here, a slow start) was a
    KeyboardInterrupt in the middle of its start, with tracebacks."""
    import signal

    code = ("import sys, time, uvicorn\nrun = uvicorn.Server.run\n"
            "def slow(self, *args, **kwargs):\n    time.sleep(1.5)\n    return run(self, *args, **kwargs)\n"
            "uvicorn.Server.run = slow\nfrom nmt.cli import main\n"
            f"sys.argv = ['nmt', 'serve', '--path', {str(checkpoint)!r}, '--port', '0']\nmain()\n")
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", code], stderr=stderr, stdout=subprocess.DEVNULL)
    try:
        wait_for_serving_line(process, log)
        process.send_signal(signal.SIGINT)
        assert process.wait(GIVE_UP) == 130
    finally:
        process.kill()
    text = log.read_text()
    assert "Ctrl-C: stopping once the requests in progress are answered" in text and "Traceback" not in text, text
