"""Where a YAML file (an `nmt run` recipe, an `nmt train --config`) may read and write.

A recipe from elsewhere is data, not code: it must not replace the user's files (``generate:
output: ~/.bashrc``) nor translate their secrets into a place it chose (``input:
~/.ssh/id_ed25519``). So every path it names resolves, symlinks followed, under its own
directory, or under the directory the user names with --output-dir (outputs and inputs) or
--input-dir (inputs); the working directory is not one of them (a recipe run from $HOME would
write there). A file a recipe writes that is already there must be one that `nmt run` wrote
(nmt/written.py), never another file of the same name; a directory it trains into must be new or
one of nmt's runs (holding a config.yaml that nmt's training wrote), never one where training
would replace, append to or prune the user's files. ``allow_outside`` (--allow-outside) trusts the
file like code and checks nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from nmt.checkpoint.names import found_member_dirs
from nmt.errors import NmtError
from nmt.files import regular_file_head
from nmt.options import options_of
from nmt.written import nmt_wrote

# The command-line options of `nmt run` and `nmt train --config` that set a Confinement.
OUTPUT_DIR_HELP = ("Let the recipe (or --config file) also write (and read) under this directory, beside its own "
                   "(`.`: the working directory, where its relative paths are taken from).")
INPUT_DIR_HELP = "Let the recipe (or --config file) also read under this directory (repeat for several)."
ALLOW_OUTSIDE_HELP = ("Let the recipe (or --config file) read and write anywhere (absolute paths, ..) and replace "
                      "any file: it is then trusted like code; and let training use a save dir that holds another "
                      "tool's config.yaml, metrics.jsonl or checkpoint*.pt.")


@dataclass(frozen=True)
class Confinement:
    """The user's choices on the command line: the places beside the file's directory, or none at all."""

    allow_outside: bool = False
    output_dir: str | None = None  # also written (and read) under
    input_dirs: tuple[str, ...] = field(default_factory=tuple)  # also read under

    @classmethod
    def from_command_line(cls, allow_outside: bool, output_dir: Path | None, input_dirs: list[Path] | None
                          ) -> Confinement:
        """From --allow-outside, --output-dir and --input-dir (repeated), as `nmt run` and `nmt train` take them."""
        return cls(allow_outside, output_dir and str(output_dir), tuple(map(str, input_dirs or [])))

    def check(self, source: Path, outputs: dict[str, str], inputs: dict[str, Any], files: Iterable[str] = (),
              what: str = "recipe", command: str = "nmt run", save_dir: str | None = None) -> None:
        """Refuse an output (``{key: path}``) or input (``{key: path or paths}``) of the YAML file ``source``
        outside its places, an existing file among ``files`` (outputs written whole) that nmt did not write,
        and a training ``save_dir`` holding files that are not an nmt run's."""
        if self.allow_outside:
            return
        writable = [real(source.parent)] + ([real(self.output_dir)] if self.output_dir else [])
        readable = writable + [real(directory) for directory in self.input_dirs]
        beside = f" or --output-dir ({writable[1]})" if self.output_dir else ""

        def outside(key: str, path: str, verb: str, flag: str) -> NmtError:
            return NmtError(f"{source}: `{key}: {path}`{where(path)} is outside the {what}'s directory "
                            f"({writable[0]}){beside}; a {what} {verb} only there unless you name a directory with "
                            f"`{command} {flag} DIR` or trust it like code with `--allow-outside`")

        for key, path in outputs.items():
            if not any(real(path).is_relative_to(root) for root in writable):
                raise outside(key, path, "writes", "--output-dir")
        for key, value in inputs.items():
            for path in paths_in(value):
                if path != "-" and not any(real(path).is_relative_to(root) for root in readable):
                    raise outside(key, path, "reads", "--input-dir")
        for path in files:
            if os.path.lexists(path) and not nmt_wrote(path):
                raise NmtError(f"{source}: {path} exists and `nmt run` did not write it; a {what} replaces only its "
                               f"own outputs: remove it, choose another path, or trust the {what} like code with "
                               "`--allow-outside`")
        if save_dir is not None and (foreign := foreign_training_files(save_dir, source)):
            raise foreign_save_dir(f"{source}: `train: save_dir: {save_dir}`", foreign, "choose another save_dir",
                                   f"trust the {what} like code with `--allow-outside`")


# What training writes in its save dir (nmt.training): its config, replaced at each start; its metrics,
# appended to; its checkpoints, replaced and pruned.
CONFIG_FILE = "config.yaml"
TRAINING_FILES = (CONFIG_FILE, "metrics.jsonl", "checkpoint*.pt")
MAX_CONFIG_BYTES = 1 << 20


def foreign_save_dir(named: str, foreign: list[str], choose: str, trust: str) -> NmtError:
    """The refusal of a save dir (``named`` as the user gave it) holding ``foreign`` files of training's names."""
    files = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    return NmtError(f"{named} holds {files}, which training would replace or append to, and is not a run of nmt's "
                    f"(no config.yaml that its training wrote): {choose}, move those files, or {trust}")


def foreign_training_files(directory: str, source: Path | None = None) -> list[str]:
    """The files of save dir ``directory``, and of its --models directories (modelK), that training would
    replace or change, where that directory is not an nmt run's (its config.yaml one that nmt's training
    wrote, and not the YAML file ``source`` itself)."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return foreign_files_of(path, source) + [f"{member.name}/{name}" for member in found_member_dirs(path)
                                               for name in foreign_files_of(member, source)]


def foreign_files_of(path: Path, source: Path | None) -> list[str]:
    found = sorted({p.name for pattern in TRAINING_FILES for p in path.glob(pattern)})
    config = path / CONFIG_FILE
    if not found or (is_written_training_config(config) and (source is None or real(config) != real(source))):
        return []
    return found


def is_written_training_config(path: Path) -> bool:
    """Whether ``path`` is a regular file (not followed through a symlink) in the schema that
    nmt.training.config.write_config writes: arch, the resolved model and every training option."""
    text = regular_file_head(path, MAX_CONFIG_BYTES + 1, follow_links=False)
    if text is None or len(text) > MAX_CONFIG_BYTES:
        return False
    try:
        document = yaml.safe_load(text.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(document, dict) and document.keys() == {"arch", "model", "train"} and \
        isinstance(document["model"], dict) and isinstance(document["train"], dict) and "save_dir" in document["train"]


def real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(path))


def where(path: str) -> str:
    """Where a path leads, when that is not what it says: a relative path (from the working directory)
    or one that a symbolic link on the way takes elsewhere (places are compared there)."""
    target = real(path)
    if target != Path(os.path.abspath(path)):
        return f" (through a symbolic link: {target})"
    return "" if os.path.isabs(path) else f" ({target})"


def paths_in(value: Any) -> list[str]:
    """The paths an option's value names: one, a list, or a ':'- or ','-separated list (an ensemble, prefixes)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [path for item in value for path in paths_in(item)]
    return [part.strip() for piece in str(value).split(",") for part in piece.split(":") if part.strip()]


def path_values(options: Any) -> dict[str, Any]:
    """An options dataclass's values of its path options (metadata ``path``), by option name."""
    values = {}
    for name, option in options_of(type(options)).items():
        if option.metadata.get("path"):
            holder = options
            for owner in option.owner:
                holder = getattr(holder, owner)
            values[name] = getattr(holder, name)
    return values
