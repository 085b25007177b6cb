"""Memory of `nmt generate`: peak RSS while decoding against the RSS of the loaded model.

    python benchmarks/decode_memory.py --path CKPT [--data DIR] [--limit N] [--settings fp32,bf16,int8]
        [--threads 1,2] [--repeats 3]

Each run is a fresh process that loads the checkpoint as `nmt generate` does, notes its resident
memory (VmRSS), resets the kernel's peak (``/proc/self/clear_refs``) and translates
test_2016_flickr.en with the default search and batching; the peak (VmHWM) is then the decoding's
own. Where the decoding workers are forked processes (two threads: nmt/generation/workers.py), they
share the model's pages with it: both figures are then the proportional set size (PSS: a page
shared by n processes counts 1/n in each), the loaded model's of the process, the peak the largest
sum over the process and its workers that a thread sampling every 20 milliseconds saw (a shorter
peak can slip between two samples). The setting shipped decodes as `nmt generate` does without speed flags
(the checkpoint's decoding record resolved as generate resolves it). The table gives the medians of
--repeats runs per setting and thread count, the ratio peak / loaded (the goal: at most 1.5) and the
CPU seconds of the decoding (its workers' included). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_speed import DEFAULT_DATA, cpu_seconds  # noqa: E402

from nmt.huge_pages import restart_with_huge_pages  # noqa: E402
from nmt.tuning import tune_for_decoding  # noqa: E402

SETTINGS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "int8": ("fp32", "int8"),  # (precision, quantize)
            "shipped": ("auto", "auto")}
SAMPLE_SECONDS = 0.02  # between two samples of the workers' memory


def status_mib(field: str) -> float:
    """A line of /proc/self/status (VmRSS, VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} in /proc/self/status: this benchmark needs Linux")


def worker() -> None:
    """``--worker``: one run as stdin's JSON asks; prints loaded RSS, decoding peak and CPU seconds as JSON."""
    job = json.loads(sys.stdin.read())
    tune_for_decoding()  # as `nmt generate` is tuned (nmt/__main__.py), before torch starts its threads
    import numpy as np
    import torch

    torch.set_num_threads(job["threads"])
    from nmt.data.vocabulary import EOS_ID
    from nmt.device import inference_device
    from nmt.device_options import InferenceDeviceOptions
    from nmt.files import read_lines
    from nmt.generation.decoding_settings import decoding_settings
    from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids
    from nmt.generation.options import BatchingOptions, SearchOptions

    precision, quantize = SETTINGS[job["setting"]]
    compute = InferenceDeviceOptions(device="cpu", precision=precision, quantize=quantize)
    decoding = decoding_settings(compute, SearchOptions(), job["path"])  # stop auto: as shipped for every setting
    compute = InferenceDeviceOptions(device="cpu", precision=precision, quantize=decoding.quantize)
    _, precision, _ = inference_device(compute)
    model, vocabs = prepare_model(job["path"], torch.device("cpu"), decoding.quantize)
    lines = read_lines(job["test"])[: job["limit"] or None]
    sources = [np.asarray(ids + [EOS_ID], dtype=np.int64) for ids in vocabs.source.encode_batch(lines)]
    loaded, loaded_pss = status_mib("VmRSS"), pss_mib(os.getpid())
    Path("/proc/self/clear_refs").write_text("5")  # the peak so far becomes the current RSS
    sampler = PssSampler()
    cpu = cpu_seconds()
    with sampler:
        translate_ids(model, sources, TranslationRequest(SearchOptions(stop=decoding.stop), BatchingOptions(),
                                                         precision=precision, shortlist=vocabs.shortlist,
                                                         fork_workers=True))  # --shortlist auto; generate's workers
    forked = sampler.peak > 0  # PSS then, before and during: shared pages counted once
    peak = sampler.peak if forked else status_mib("VmHWM")
    print(json.dumps({"loaded": loaded_pss if forked else loaded, "peak": peak, "measure": "PSS" if forked else "RSS",
                      "cpu": cpu_seconds() - cpu, "decoding": decoding.describe()}))


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PssSampler(threading.Thread):
    """The largest sum of PSS over this process and its children, sampled until the block ends."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.done.wait(SAMPLE_SECONDS):
            children = [int(pid) for task in Path(f"/proc/{me}/task").iterdir()
                        for pid in (task / "children").read_text().split()]
            if not children:  # one worker: VmHWM is exact, and reading PSS costs CPU time
                continue
            total = 0.0
            for pid in [me, *children]:
                try:
                    total += pss_mib(pid)
                except (FileNotFoundError, ProcessLookupError):  # a worker that just ended
                    pass
            self.peak = max(self.peak, total)

    def __enter__(self) -> PssSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()


def run(setting: str, threads: int, path: Path, test: Path, limit: int) -> dict:
    job = json.dumps({"setting": setting, "threads": threads, "path": str(path), "test": str(test), "limit": limit})
    done = subprocess.run([sys.executable, __file__, "--worker"], input=job, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        return worker()
    restart_with_huge_pages()  # as `nmt` starts itself; its workers inherit the setting (nmt/huge_pages.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, required=True, help="a trained checkpoint")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with Multi30k's .gz files")
    parser.add_argument("--limit", type=int, default=0, help="translate only the first N test sentences")
    parser.add_argument("--settings", default="shipped,fp32,bf16,int8",
                        help=f"comma-separated, from {', '.join(SETTINGS)}")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the table shows medians")
    args = parser.parse_args()
    test = args.data / "test_2016_flickr.en.gz"
    if not test.exists():
        raise SystemExit(f"Multi30k not found in {args.data} (set --data or NMT_MULTI30K)")
    table = Table(title=f"nmt generate's memory (default search and batching), {args.path}, "
                        f"test_2016_flickr{f' (first {args.limit})' if args.limit else ''}, median of {args.repeats}")
    for column in ("setting", "threads", "measure", "loaded (MiB)", "decoding peak (MiB)", "peak / loaded",
                   "CPU seconds"):
        table.add_column(column, justify="right")
    for threads in (int(t) for t in args.threads.split(",")):
        for setting in args.settings.split(","):
            runs = [run(setting, threads, args.path, test, args.limit) for _ in range(args.repeats)]
            loaded, peak, cpu = (statistics.median(r[key] for r in runs) for key in ("loaded", "peak", "cpu"))
            measure = "/".join(sorted({r["measure"] for r in runs}))
            table.add_row(setting, str(threads), measure, f"{loaded:.0f}", f"{peak:.0f}", f"{peak / loaded:.2f}",
                          f"{cpu:.1f}")
            Console(stderr=True).print(f"done: {setting}, {threads} thread(s): {runs}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
