"""`nmt archs`: the registry as a table."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from nmt.data.vocabulary import PAD_ID
from nmt.log import stdout_console
from nmt.models.registry import ARCHS, build_model, count_parameters, get_arch


def print_arch_table(vocab_size: int, console: Console | None = None) -> None:
    get_arch("transformer_base")  # loads the built-in archs
    table = Table(title=f"architectures (parameters with a joint vocabulary of {vocab_size:,})", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for column in ("arch", "params", "layers", "d_model", "ffn", "heads", "dropout", "norm"):
        table.add_column(column, justify="left" if column == "arch" else "right", no_wrap=True)
    for name in sorted(ARCHS):
        arch = ARCHS[name]
        c = arch.config
        model = build_model(arch.model_name, c, vocab_size, vocab_size, PAD_ID)
        table.add_row(name, f"{count_parameters(model) / 1e6:.1f}M", f"{c.encoder_layers}+{c.decoder_layers}",
                      str(c.d_model), str(c.ffn_dim), str(c.heads), str(c.dropout),
                      "pre" if c.normalize_before else "post")
    (console or stdout_console()).print(table)
