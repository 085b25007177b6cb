"""The CLI's shared conventions: version, help, listing archs, one-line errors."""

import pytest
from typer.testing import CliRunner

import nmt
from nmt.cli import app
from conftest import run_nmt

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"nmt {nmt.__version__}"


def test_help_lists_archs_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "archs" in result.output


@pytest.mark.slow
def test_archs_table_has_paper_models():
    result = runner.invoke(app, ["archs", "--vocab-size", "37000"], terminal_width=200)
    assert result.exit_code == 0
    assert "transformer_base" in result.output and "63.1M" in result.output
    assert "transformer_big" in result.output and "214.2M" in result.output


@pytest.mark.slow
def test_bad_option_value_is_a_usage_error_without_traceback():
    result = run_nmt("archs", "--vocab-size", "many")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("delay", [0.2, 1.0])
def test_ctrl_c_while_loading_or_waiting_ends_quietly_with_130(delay, tmp_path):
    """At 0.2 s the libraries are still loading; by 1 s (on a fast machine) generate may be waiting for stdin:
    either way one signal ends it without a traceback."""
    import signal
    import subprocess
    import sys
    import time

    process = subprocess.Popen([sys.executable, "-m", "nmt", "generate", "-i", "-", "--path", str(tmp_path / "m.pt")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert "Traceback" not in err
    assert process.returncode in (130, 1)  # 1: the missing checkpoint was reported before the signal
    assert process.returncode == 130 or err.startswith("error: checkpoint not found")
