"""What ``nmt preprocess`` reports: a log line per split as it is written, and the table the CLI prints."""

from __future__ import annotations

from rich.table import Table

from nmt.data.dataset import DataDir
from nmt.data.meta import SplitMeta
from nmt.log import logger


def format_dropped(dropped: dict[str, int]) -> str:
    """E.g. "12: empty 3, too long 9" (only the reasons that dropped something)."""
    reasons = ", ".join(f"{reason.replace('_', ' ')} {count:,}" for reason, count in dropped.items() if count)
    return f"{sum(dropped.values()):,}" + (f": {reasons}" if reasons else "")


def unk_rate(unknown: int, tokens: int, sentences: int) -> float:
    """Share of UNK among a side's real tokens (the EOS of each sentence not counted)."""
    real = tokens - sentences
    return unknown / real if real else 0.0


def log_split(name: str, entry: SplitMeta) -> None:
    dropped = f", dropped {format_dropped(entry.dropped)}" if entry.dropped is not None else ""
    logger.info(f"{name}: {entry.sentences} pairs, {entry.source_tokens} + {entry.target_tokens} tokens{dropped}",
                extra={"fields": {"split": name, **entry.to_json()}})


def summary_table(datadir: DataDir) -> Table:
    """Sentences, tokens (EOS included), unknown-token rate and dropped pairs per split."""
    meta, source, target = datadir.meta, datadir.source_lang, datadir.target_lang
    table = Table(title=f"{datadir.path}  ({source}-{target}, vocab "
                        f"{'/'.join(str(n) for n in dict.fromkeys(meta.vocab_sizes.values()))}"
                        f"{', joint' if meta.joint else ''})")
    for column in ("split", "sentences", f"{source} tokens", f"{target} tokens", f"{source} unk", f"{target} unk"):
        table.add_column(column, justify="left" if column == "split" else "right")
    table.add_column("dropped")
    for name, entry in meta.splits.items():
        table.add_row(name, f"{entry.sentences:,}", f"{entry.source_tokens:,}", f"{entry.target_tokens:,}",
                      f"{unk_rate(entry.source_unk, entry.source_tokens, entry.sentences):.3%}",
                      f"{unk_rate(entry.target_unk, entry.target_tokens, entry.sentences):.3%}",
                      format_dropped(entry.dropped) if entry.dropped is not None else "-")
    if meta.samples:
        table.caption = (f"and {len(meta.samples)} sampled segmentations of train (--subword-samples), "
                         f"{meta.sample_tokens()} tokens each, read one an epoch")
    return table
