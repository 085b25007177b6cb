"""The CLI's shared conventions: version, help, listing archs, one-line errors."""

import re
import subprocess
import sys

import pytest
from conftest import run_nmt
from typer.testing import CliRunner

import nmt
from nmt.cli import app

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
def test_archs_table_is_whole_when_piped():
    """Piped, rich would cut the table to 80 columns (d_mod…, hea…, no…)."""
    result = run_nmt("archs")
    assert result.returncode == 0
    header = next(line for line in result.stdout.splitlines() if line.strip().startswith("arch "))
    assert header.split() == ["arch", "params", "layers", "d_model", "ffn", "heads", "dropout", "norm"]
    assert "…" not in result.stdout


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


def test_ctrl_c_in_a_command_ends_with_130_and_says_so(monkeypatch, capsys):
    """typer turns the KeyboardInterrupt into exit code 130 and says nothing; the CLI says it."""
    import nmt.generation.generate as generate_module
    from nmt.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_module, "generate", interrupted)
    monkeypatch.setattr("sys.argv", ["nmt", "generate", "-i", "-", "--path", "model.pt"])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["average", "--help"], ["run", "--help"]])
def test_flags_are_shown_without_a_value_type(argv):
    """A flag takes no value: `--quiet <bool>` in the help invites `--quiet true`, which then fails."""
    result = CliRunner().invoke(app, argv, terminal_width=200)
    assert result.exit_code == 0
    assert "<bool>" not in result.output
    assert "--help" in result.output
    if argv != ["--help"]:  # -v counts (-vv): no value to give
        assert not re.search(r"--verbose\s+-v\s+<int>", result.output), result.output


def test_arguments_are_named_one_way_in_usage_lines():
    for argv, usage in [(["average", "--help"], "{INPUTS}..."), (["generate", "--help"], "[DATA_DIR]"),
                        (["run", "--help"], "{RECIPE}"),
                        (["export", "ctranslate2", "--help"], "{CHECKPOINT} {OUTDIR}")]:
        result = CliRunner().invoke(app, argv, terminal_width=200)
        assert usage in result.output.splitlines()[1], result.output.splitlines()[1]


def test_path_options_reach_the_library_as_text(tmp_path, monkeypatch, capsys):
    """typer parses path options as Path; the options dataclasses hold text, as from a recipe."""
    from nmt.options import build
    from nmt.scoring import ScoreOptions

    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("a b c\n")
    ref.write_text("a b c\n")
    result = run_nmt("score", "--sys", hyp, "--ref", ref)
    assert result.returncode == 0 and "BLEU" in result.stdout
    assert build(ScoreOptions, {"system": str(hyp), "ref": [str(ref)]}).ref == [str(ref)]


@pytest.mark.parametrize("argv", [[], ["plot"], ["export"]])
def test_a_command_group_without_its_command_shows_its_help_once(argv):
    result = subprocess.run([sys.executable, "-m", "nmt", *argv], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout.count("Usage:") == 1 and result.stderr == ""
