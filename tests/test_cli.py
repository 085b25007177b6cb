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


def test_ctrl_c_while_the_libraries_load_ends_quietly_with_130(monkeypatch, capsys):
    """The console script's import of nmt.cli (torch: seconds) is where an early Ctrl-C lands."""
    import sys
    import types

    import nmt.__main__

    class Loading(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "nmt.cli", Loading("nmt.cli"))
    with pytest.raises(SystemExit) as stopped:
        nmt.__main__.main()
    assert stopped.value.code == 130 and capsys.readouterr().err == "interrupted\n"
