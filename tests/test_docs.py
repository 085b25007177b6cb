"""docs/cli.md is generated from the CLI; it must say what `nmt --help` says."""

import subprocess
import sys
from pathlib import Path

import pytest

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
REGENERATE = "typer nmt.cli utils docs --name nmt --output docs/cli.md"


@pytest.mark.slow
def test_cli_reference_is_up_to_date():
    generated = subprocess.run([sys.executable, "-m", "typer", "nmt.cli", "utils", "docs", "--name", "nmt"],
                               capture_output=True, text=True, check=True).stdout
    assert CLI_DOC.read_text(encoding="utf-8").strip() == generated.strip(), f"docs/cli.md is stale: run {REGENERATE}"
