"""The options of ``nmt generate``, the API and the server's search: what to translate, how to
search and batch, on what device. Torch-free, so that `nmt --help` does not import torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nmt.checkpoint.names import split_paths
from nmt.data.meta import is_data_directory
from nmt.device_options import BLEU_TOLERANCE, PANEL, InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.files import is_zip_file, refuse_overwriting
from nmt.options import check_values
from nmt.scoring import AUTO, LOWERCASE_HELP, TOKENIZE_HELP, BleuTokenizer

LenpenStyle = Literal["gnmt", "fairseq"]

# What decides whether finished search keeps exact search's translations: the decoding check's
# verdict on the stop rule holds for the search it ran with these values only.
CHECKED_SEARCH = ("beam", "lenpen", "lenpen_style", "max_len_a", "max_len_b", "min_len")


@dataclass(frozen=True)
class SearchOptions:
    """How to search: beam size, length penalty and limits, or sampling. Checks its own bounds."""

    beam: int = field(default=4, metadata={"help": "Beam size (1 = greedy).", "min": 1})
    lenpen: float = field(default=0.6, metadata={"help": "Length penalty alpha.", "min": -5.0, "max": 5.0})
    lenpen_style: LenpenStyle = field(default="gnmt", metadata={
        "help": "gnmt: score / ((5+|Y|)/6)^alpha (the paper's); fairseq: score / |Y|^alpha."})
    max_len_a: float = field(default=1.0, metadata={"help": "Max output length = a * source length + b.", "min": 0})
    max_len_b: int = field(default=50, metadata={"help": "See --max-len-a.", "min": 0})
    min_len: int = field(default=1, metadata={"help": "Min output length (EOS excluded).", "min": 0})
    no_repeat_ngram_size: int = field(default=0, metadata={"help": "Never repeat an n-gram of this size (0 = off).",
                                                           "min": 0})
    nbest: int = field(default=1, metadata={"help": "Hypotheses to output per sentence, at most --beam.", "min": 1})
    stop: Literal["auto", "exact", "current", "finished"] = field(default="auto", metadata={
        "help": "When a sentence's search ends. exact: once no unfinished hypothesis can beat its --beam finished "
                "ones; current: once none would beat them if it ended at the next step (Hugging Face's default "
                "rule: with a positive --lenpen a longer one could still win); finished: as soon as --beam "
                "hypotheses have finished (fairseq's and CTranslate2's rule; it can keep a short hypothesis that "
                "exact search would have beaten). current and finished are faster with a positive --lenpen. auto: "
                f"the fastest rule with which the checkpoint's validation check kept BLEU (within {BLEU_TOLERANCE}; "
                "`nmt average` and training's end record it), else exact: docs/translating.md."})
    shortlist: Literal["auto", "none"] = field(default="auto", metadata={
        "help": "Vocabulary shortlist. auto: where the checkpoint has one (learned by `nmt preprocess`), score "
                "only each sentence's candidate target pieces (its source pieces' likely translations and the "
                "frequent pieces), not the whole vocabulary: faster on a CPU. Never on a GPU, where it is slower, nor "
                "with --sampling, which draws from the whole distribution. none: always the whole vocabulary."})
    sampling: bool = field(default=False, metadata={"help": "Sample instead of searching."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature.", "above": 0.0})
    topk: int = field(default=0, metadata={"help": "Sample from the k likeliest tokens (0 = all).", "min": 0})
    topp: float = field(default=0.0, metadata={"help": "Nucleus sampling mass (0 = off).", "min": 0.0, "max": 1.0})
    seed: int = field(default=1, metadata={"help": "Random seed for sampling.", "min": 0})

    def checked(self) -> dict[str, Any]:
        """What the decoding check's verdict on the stop rule depends on (CHECKED_SEARCH), by name."""
        return {name: getattr(self, name) for name in CHECKED_SEARCH}

    def __post_init__(self) -> None:
        check_values(self)
        if self.nbest > self.beam:
            raise NmtError(f"--nbest must be between 1 and --beam ({self.beam}), got {self.nbest}")
        if (self.topk or self.topp) and not self.sampling:
            raise NmtError("--topk/--topp only apply with --sampling")
        if self.max_len_a == 0 and self.min_len > max(1, self.max_len_b):  # max_lengths gives at least 1
            raise NmtError(f"--min-len {self.min_len} is over the max length --max-len-b {self.max_len_b} "
                           "(with --max-len-a 0)")


def checked(name: str, what: str) -> Any:
    """The field of the check's twin of SearchOptions' ``name``: the same default and bounds."""
    spec = next(spec for spec in dataclasses.fields(SearchOptions) if spec.name == name)
    help_text = f"The decoding check's {what}: `nmt generate --stop auto` takes its choice with this --{name} only."
    return field(default=spec.default, metadata={**spec.metadata, "help": help_text.replace("_", "-")})


@dataclass(frozen=True)
class CheckSearchOptions:
    """The search the decoding check (nmt/training/decoding_check.py) decodes the validation set with,
    for `nmt average` and training's end: by default generate's; a recipe gives its generate stage's."""

    check_beam: int = checked("beam", "beam size")
    check_lenpen: float = checked("lenpen", "length penalty")
    check_lenpen_style: LenpenStyle = checked("lenpen_style", "length penalty style")
    check_max_len_a: float = checked("max_len_a", "max length's a")
    check_max_len_b: int = checked("max_len_b", "max length's b")
    check_min_len: int = checked("min_len", "min length")

    def __post_init__(self) -> None:
        check_values(self)
        self.search()  # and what SearchOptions checks across its values

    def search(self) -> SearchOptions:
        """The search the check runs (its stop rule set per setting tried)."""
        return SearchOptions(**{name: getattr(self, f"check_{name}") for name in CHECKED_SEARCH})

    @staticmethod
    def values_for(search: SearchOptions) -> dict[str, Any]:
        """The options that name ``search`` (a recipe's generate stage's), by option name."""
        return {f"check_{name}": value for name, value in search.checked().items()}


CPU_MAX_TOKENS, GPU_MAX_TOKENS = 8000, 32000  # --max-tokens 0 (the default), by device: docs/performance.md


@dataclass(frozen=True)
class BatchingOptions:
    """How sentences are grouped for the model; in fp32, and in int8 with nmt's C kernels, the output
    never depends on it (docs/translating.md: batch dependence)."""

    max_tokens: int | None = field(default=0, metadata={
        "help": "Source tokens x beam decoded at once; --workers share them (each batch gets its share). "
                "0: by device, 8,000 on a CPU (larger batches gained nothing there and held more memory), "
                "32,000 on a GPU (2-3x as fast as 8,000 on an H200).", "min": 0})
    batch_size: int | None = field(default=None, metadata={"help": "Sentences per batch at most.", "min": 1})
    workers: int | None = field(default=None, metadata={
        "help": "Batches decoded at the same time, sharing the CPU threads (--threads; CTranslate2's "
                "inter_threads); each gets at least one, so more workers than threads share cores. On Linux a "
                "worker with one thread is a process forked after loading (it shares the weights), else a thread. "
                "Unset: on CPU, one per thread (at most one per sentence): a step's many small operations barely "
                "use a second thread, a second batch does (--engine ctranslate2: one per thread, its inter_threads, "
                "set as it loads); 1 with --sampling and on a GPU.",
        "min": 1})

    def __post_init__(self) -> None:
        check_values(self)
        if self.max_tokens is None and self.batch_size is None:
            raise NmtError("give --max-tokens or --batch-size")

    def tokens_for(self, device_type: str) -> int | None:
        """--max-tokens, its 0 resolved for the device (None: no token limit, --batch-size alone)."""
        if self.max_tokens == 0:
            return CPU_MAX_TOKENS if device_type == "cpu" else GPU_MAX_TOKENS
        return self.max_tokens


@dataclass(frozen=True)
class GenerateOptions:
    """The options of ``nmt generate``: what to translate, where to write it, on what device, and the
    search and batching options composed in. Option names are the CLI's and the recipe's keys."""

    data: str | None = field(default=None, metadata={"path": True,
        "help": "Data directory from `nmt preprocess` (or use --input).", "argument": True, "metavar": "DATA_DIR"})
    path: list[str] = field(default_factory=lambda: ["checkpoints/checkpoint_best.pt"], metadata={"path": True,
        "help": "Checkpoint to translate with; several (a.pt:b.pt, or --path repeated) decode as an ensemble."})
    split: str = field(default="test", metadata={"help": "Split of DATA_DIR to translate."})
    input: str | None = field(default=None, metadata={"path": True,
        "help": "Raw source text instead of DATA_DIR, one sentence a line ('-' = stdin, translated as lines arrive).",
        "flags": ["--input", "-i"]})
    output: str | None = field(default=None, metadata={"path": True,
        "help": "Write here (atomically) instead of stdout.", "flags": ["--output", "-o"]})
    buffer_size: int | None = field(default=None, metadata={
        "help": "Streaming stdin: translate N lines at a time (waiting for N) instead of whatever has arrived.",
        "min": 1})
    prefix: str | None = field(default=None, metadata={"path": True,
        "help": "Target prefixes, one a line for the input's lines (an empty line: none): each translation begins "
                "with its prefix and the score is the continuation's. Stdin as it arrives: use --prefix-column.",
        "panel": "Controls"})
    prefix_column: bool = field(default=False, metadata={
        "help": "Raw input lines are source<TAB>prefix (an empty prefix: none), before any constraints.",
        "panel": "Controls"})
    constraints: bool = field(default=False, metadata={
        "help": "Raw input lines are source<TAB>constraint<TAB>...: target phrases each translation must contain "
                "(fairseq's form; after the prefix with --prefix-column). Slower; a larger --beam helps.",
        "panel": "Controls"})
    ban: str | None = field(default=None, metadata={"path": True,
        "help": "Target phrases no translation may contain, one a line.", "panel": "Controls"})
    format: Literal["plain", "fairseq"] = field(default="plain", metadata={
        "help": "plain: one translation per line; fairseq: S-/T-/H-/D-/P- lines."})
    print_scores: bool = field(default=False, metadata={
        "help": "Plain format: prefix each line with its score and a tab."})
    print_alignment: bool = field(default=False, metadata={
        "help": "Add each translation's word alignment (srcpos-tgtpos pairs from the cross-attention): a tab-separated "
                "column in plain format, A- lines in fairseq format."})
    alignment_layer: int | None = field(default=None, metadata={
        "help": "Decoder layer whose heads' mean attention gives the alignment, from 1; unset: the penultimate.",
        "min": 1})
    print_attention: str | None = field(default=None, metadata={"path": True,
        "help": "Write each best translation's word-level soft attention to this JSON-lines file."})
    score_reference: bool = field(default=False, metadata={
        "help": "Print BLEU (on stderr) against the split's raw reference file, or its target side if that is gone."})
    tokenize: BleuTokenizer = field(default=AUTO, metadata={"help": f"With --score-reference: {TOKENIZE_HELP}"})
    lowercase: bool = field(default=False, metadata={"help": f"With --score-reference: {LOWERCASE_HELP}"})
    engine: Literal["nmt", "ctranslate2"] = field(default="nmt", metadata={
        "help": "nmt: its own decoder; ctranslate2: CTranslate2 (the ct2 extra of nmt) on --path, a directory "
                "from `nmt export ctranslate2` or a checkpoint (exported to a temporary directory). Its length "
                "penalty is fairseq's (--lenpen-style gnmt is decoded so, with a warning); outputs can differ: see "
                "nmt/generation/ctranslate2_engine.py."})
    compute: InferenceDeviceOptions = field(default_factory=InferenceDeviceOptions, metadata={
        "help": "Device options.", "panel": PANEL})
    search: SearchOptions = field(default_factory=SearchOptions, metadata={
        "help": "Search options.", "panel": "Search"})
    batching: BatchingOptions = field(default_factory=BatchingOptions, metadata={
        "help": "Batching options.", "panel": "Batching"})

    def __post_init__(self) -> None:
        check_values(self)
        if (self.data is None) == (self.input is None):
            raise NmtError("give either DATA_DIR (with --split) or --input FILE|-")
        if self.alignment_layer is not None and not (self.print_alignment or self.print_attention):
            raise NmtError("--alignment-layer applies with --print-alignment or --print-attention")
        if self.engine == "ctranslate2" and (self.print_alignment or self.print_attention):
            raise NmtError("--print-alignment and --print-attention need --engine nmt (attention weights)")
        if self.engine == "ctranslate2" and self.compute.backend != "auto":
            raise NmtError("--backend chooses what nmt's own decoder computes with: it needs --engine nmt")
        check_workers(self.search, self.batching)
        self.check_controls()
        if self.print_scores and self.format != "plain":
            raise NmtError("--print-scores is for --format plain (fairseq's H- lines carry the scores)")
        if self.buffer_size is not None and (self.input != "-" or self.output is not None):
            raise NmtError("--buffer-size applies to translating stdin as it arrives (--input - and no --output)")
        inputs = {"--input": self.input, "--path": [item for path in self.path for item in split_paths(path)],
                  "--prefix": self.prefix, "--ban": self.ban}
        refuse_overwriting("--output", self.output, {**inputs, "--print-attention": self.print_attention})
        refuse_overwriting("--print-attention", self.print_attention, inputs)
        for flag, output in (("--output", self.output), ("--print-attention", self.print_attention)):
            refuse_replacing_nmt_files(flag, output)
        if self.score_reference and self.data is None:
            raise NmtError("--score-reference needs a binarized split (DATA_DIR --split); "
                           "for raw input use `nmt score --ref FILE` on the output")

    def check_controls(self) -> None:
        if (self.prefix_column or self.constraints) and self.input is None:
            raise NmtError("--prefix-column and --constraints read raw text lines (--input FILE|-); for a binarized "
                           "split give --prefix FILE")
        if self.prefix is not None and self.prefix_column:
            raise NmtError("give the prefixes either as --prefix FILE or in the input (--prefix-column), not both")
        if self.constraints and self.search.sampling:
            raise NmtError("--constraints need beam search: they cannot be used with --sampling")
        if self.constraints and self.engine == "ctranslate2":
            raise NmtError("--engine ctranslate2 has no lexical constraints (only prefixes and bans): use --engine nmt")


def refuse_replacing_nmt_files(flag: str, output: str | None) -> None:
    """Translations written into a data directory or over a checkpoint (another run's, or a save
    dir's) would destroy what a command did not name as its input: refused before any work."""
    if output is None or output == "-":
        return
    path = Path(output)
    if is_data_directory(path.parent):
        raise NmtError(f"{flag} {output} is in the data directory {path.parent}: writing it there could destroy "
                       "its files; choose another path")
    if is_zip_file(path):
        raise NmtError(f"{flag} {output} is a checkpoint (a zip file, as torch.save writes): writing it would "
                       "destroy it; choose another path")


def check_workers(search: SearchOptions, batching: BatchingOptions, device_type: str | None = None) -> None:
    """Sampling draws from one random generator: batches on several threads would make the draws
    depend on the threads' timing. On a GPU one batch already fills the device, and the attention
    backend switch (attention.py) is process-wide, not per thread."""
    if (batching.workers or 1) > 1 and search.sampling:
        raise NmtError("--workers > 1 cannot be used with --sampling: the draws would depend on the threads' timing")
    if (batching.workers or 1) > 1 and device_type not in (None, "cpu"):
        raise NmtError(f"--workers > 1 is for CPU decoding; on {device_type} use larger batches (--max-tokens)")


def choose_workers(search: SearchOptions, batching: BatchingOptions, device_type: str, threads: int,
                   sentences: int) -> int:
    """``--workers`` as given; by default, on CPU, one per thread (``threads``) and at most one per
    sentence, each batch on one thread. Two workers decoded 1.13-1.27x as many sentences per second
    as one batch on two threads on an idle machine, and on a busy one that batch's two threads
    waited on each other for 7x the time (docs/performance.md)."""
    if batching.workers is not None:
        return batching.workers
    if search.sampling or device_type != "cpu":
        return 1
    return max(1, min(threads, sentences))
