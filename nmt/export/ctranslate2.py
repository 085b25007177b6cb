"""``nmt export ctranslate2``: a checkpoint as a CTranslate2 model directory.

The spec is filled directly from the state_dict with CTranslate2's own Python spec API, as its
fairseq and OpenNMT-py converters do. What CTranslate2 must be told about nmt's Transformer:
post-norm (``pre_norm=False``) or pre-norm; embeddings scaled by sqrt(d_model); nmt's sinusoidal
table written out explicitly, because CTranslate2's built-in one differs (positions from 1,
[sin | cos] halves, another frequency step) while nmt's starts at 0 with sin at even and cos at
odd dimensions; fused q/k/v projections; tokens as sentencepiece pieces, the decoder starting
from BOS and the source ending in EOS (``add_source_eos``). A tied embedding is given to every
place that uses it; CTranslate2 stores identical variables once. The directory also holds the
sentencepiece model(s) and ``nmt.json`` (languages and file names), so that ``nmt generate
--engine ctranslate2 --path DIR`` and other tools can use it. A checkpoint's vocabulary shortlist
becomes CTranslate2's vocabulary map (``vmap.txt``, used with ``translate_batch(use_vmap=True)``)
and is kept as ``shortlist.npz`` too. The position table has
``max_positions`` rows (the model config's, 1024 by default): CTranslate2 refuses longer inputs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from nmt.checkpoint.format import Vocabularies, load_checkpoint, model_from_checkpoint
from nmt.data.shortlist import SHORTLIST_FILE, Shortlist
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocabulary
from nmt.errors import NmtError, install_hint
from nmt.export.options import ExportOptions
from nmt.files import atomic_directory
from nmt.log import logger
from nmt.models.transformer import sinusoidal_positions

if TYPE_CHECKING:
    from ctranslate2.specs import TransformerSpec

META_FILE = "nmt.json"
VMAP_FILE = "vmap.txt"  # the name CTranslate2 gives its vocabulary map
EXPORTABLE_MODELS = ("transformer",)
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which nmt's Transformer uses


def import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise NmtError(f"CTranslate2 is not installed: {install_hint('ct2')}") from None
    return ctranslate2


def export_ctranslate2(options: ExportOptions) -> Path:
    """Write the CTranslate2 model directory; returns its path."""
    import_ctranslate2()
    outdir = Path(options.outdir)
    if outdir.exists() and not (outdir.is_dir() and not any(outdir.iterdir())):
        if not (outdir / META_FILE).is_file():
            raise NmtError(f"{outdir} already exists and is not an export of `nmt export ctranslate2` (no "
                           f"{META_FILE}): choose another OUTDIR (--force only replaces an earlier export)")
        if not options.force:
            raise NmtError(f"{outdir} already exists: use --force to replace it")
        if Path(options.checkpoint).resolve().is_relative_to(outdir.resolve()):
            raise NmtError(f"{outdir} holds the checkpoint {options.checkpoint}: replacing it would delete it; "
                           "export to another OUTDIR")
    checkpoint = load_checkpoint(options.checkpoint)
    spec = transformer_spec(checkpoint)
    spec.validate()
    spec.optimize(quantization=options.quantization)
    vocabs = Vocabularies.from_state(checkpoint["vocab"])
    try:
        with atomic_directory(outdir) as workdir, tempfile.TemporaryDirectory(prefix="nmt-vmap-") as tmp:
            if vocabs.shortlist is not None:
                spec.register_vocabulary_mapping(str(write_vmap(Path(tmp) / VMAP_FILE, vocabs)))
            spec.save(str(workdir))
            write_vocabularies(workdir, vocabs, options, checkpoint["model_config"].get("max_positions"))
    except OSError as exc:
        raise NmtError(f"cannot write {outdir}: {exc}") from exc
    logger.info("exported %s (%s) to %s as CTranslate2 %s", options.checkpoint, checkpoint["arch"], outdir,
                options.quantization)
    return outdir


def transformer_spec(checkpoint: dict[str, Any]) -> "TransformerSpec":
    """The CTranslate2 spec of an nmt Transformer checkpoint, weights filled in (float32)."""
    from ctranslate2.specs import TransformerSpec

    if checkpoint["model_name"] not in EXPORTABLE_MODELS:
        raise NmtError(f"cannot export model {checkpoint['model_name']!r} (arch {checkpoint['arch']!r}) to "
                       f"CTranslate2: only {', '.join(EXPORTABLE_MODELS)} is supported")
    model, vocabs = model_from_checkpoint(checkpoint)
    config = model.config
    weights = model.state_dict()
    spec = TransformerSpec.from_config((config.encoder_layers, config.decoder_layers), config.heads,
                                       pre_norm=config.normalize_before)
    positions = as_array(sinusoidal_positions(config.max_positions, config.d_model))
    fill_stack(spec.encoder, weights, "encoder", "src_embed", positions, config.normalize_before)
    fill_stack(spec.decoder, weights, "decoder", "tgt_embed", positions, config.normalize_before)
    spec.decoder.projection.weight = as_array(model.output_weight())
    spec.register_source_vocabulary(pieces(vocabs.source))
    spec.register_target_vocabulary(pieces(vocabs.target))
    spec.config.unk_token = vocabs.target.piece(UNK_ID)
    spec.config.bos_token = vocabs.target.piece(BOS_ID)
    spec.config.eos_token = vocabs.target.piece(EOS_ID)
    spec.config.decoder_start_token = vocabs.target.piece(BOS_ID)
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    return spec


def fill_stack(spec, weights: dict[str, Tensor], stack: str, embedding: str, positions: np.ndarray,
               pre_norm: bool) -> None:
    """Embeddings, positions, layers and (pre-norm) final norm of the encoder or the decoder."""
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = as_array(weights[f"{embedding}.weight"])
    spec.scale_embeddings = True  # by sqrt(d_model), as nmt does
    spec.position_encodings.encodings = positions
    for i, layer in enumerate(spec.layer):
        prefix = f"{stack}_layers.{i}"
        if stack == "encoder":
            fill_attention(layer.self_attention, weights, f"{prefix}.self_attn", f"{prefix}.attn_block.norm", True)
        else:
            fill_attention(layer.self_attention, weights, f"{prefix}.self_attn", f"{prefix}.self_block.norm", True)
            fill_attention(layer.attention, weights, f"{prefix}.cross_attn", f"{prefix}.cross_block.norm", False)
        fill_linear(layer.ffn.linear_0, weights, f"{prefix}.ffn.fc1")
        fill_linear(layer.ffn.linear_1, weights, f"{prefix}.ffn.fc2")
        fill_layer_norm(layer.ffn.layer_norm, weights, f"{prefix}.ffn_block.norm")
    if pre_norm:
        fill_layer_norm(spec.layer_norm, weights, f"{stack}_norm")


def fill_attention(spec, weights: dict[str, Tensor], name: str, norm: str, self_attention: bool) -> None:
    """CTranslate2 fuses q, k and v (self-attention) or k and v (encoder-decoder attention)."""
    fused = ("q_proj", "k_proj", "v_proj") if self_attention else ("k_proj", "v_proj")
    if not self_attention:
        fill_linear(spec.linear[0], weights, f"{name}.q_proj")
    fused_linear = spec.linear[0 if self_attention else 1]
    fused_linear.weight = np.concatenate([as_array(weights[f"{name}.{proj}.weight"]) for proj in fused])
    fused_linear.bias = np.concatenate([as_array(weights[f"{name}.{proj}.bias"]) for proj in fused])
    fill_linear(spec.linear[-1], weights, f"{name}.out_proj")
    fill_layer_norm(spec.layer_norm, weights, norm)


def fill_linear(spec, weights: dict[str, Tensor], name: str) -> None:
    spec.weight = as_array(weights[f"{name}.weight"])
    spec.bias = as_array(weights[f"{name}.bias"])


def fill_layer_norm(spec, weights: dict[str, Tensor], name: str) -> None:
    spec.gamma = as_array(weights[f"{name}.weight"])
    spec.beta = as_array(weights[f"{name}.bias"])


def as_array(tensor: Tensor) -> np.ndarray:
    return tensor.detach().float().contiguous().numpy()


def pieces(vocab: Vocabulary) -> list[str]:
    return [vocab.piece(i) for i in range(len(vocab))]


def write_vmap(path: Path, vocabs: Vocabularies) -> Path:
    """The shortlist as CTranslate2's vocabulary map: a line per source piece, the piece, a tab and its
    candidates separated by spaces; the line with no piece lists the candidates of every sentence.
    (CTranslate2 adds the special tokens itself, and takes the union over a batch.)"""
    source, target = vocabs.source, vocabs.target
    lines = ["\t" + " ".join(target.piece(int(t)) for t in vocabs.shortlist.frequent)]
    for piece, row in enumerate(vocabs.shortlist.translations):
        candidates = [target.piece(int(t)) for t in row if t != PAD_ID]
        if candidates and piece != PAD_ID:
            lines.append(f"{source.piece(piece)}\t{' '.join(candidates)}")
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_vocabularies(directory: Path, vocabs: Vocabularies, options: ExportOptions,
                       max_positions: int | None) -> None:
    """The sentencepiece model(s) beside the CTranslate2 model, and nmt.json naming them (and the
    positions the model has, which caps the output length as nmt's own search does; and the
    shortlist, which tells `--engine ctranslate2` that the vocabulary map may be used)."""
    files = {"source": "sentencepiece.model", "target": "sentencepiece.model"} if vocabs.joint else \
        {"source": "source.model", "target": "target.model"}
    vocabs.source.save(directory / files["source"])
    vocabs.target.save(directory / files["target"])
    meta = {"source_lang": vocabs.source_lang, "target_lang": vocabs.target_lang,
            "source_spm": files["source"], "target_spm": files["target"],
            "checkpoint": str(options.checkpoint), "quantization": options.quantization,
            "max_positions": max_positions}
    if vocabs.shortlist is not None:
        vocabs.shortlist.save(directory / SHORTLIST_FILE)
        meta["shortlist"] = SHORTLIST_FILE
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def export_meta(directory: Path) -> dict[str, Any]:
    """nmt.json of a directory written by :func:`export_ctranslate2`."""
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise NmtError(f"{directory} is not a model directory from `nmt export ctranslate2` (no {META_FILE})")
    return json.loads(meta_path.read_text(encoding="utf-8"))


def load_vocabularies(directory: Path) -> Vocabularies:
    """The vocabularies of a directory written by :func:`export_ctranslate2`."""
    meta = export_meta(directory)
    source, target = Vocabulary.load(directory / meta["source_spm"]), Vocabulary.load(directory / meta["target_spm"])
    shortlist = Shortlist.load(directory / meta["shortlist"], len(source), len(target)) if "shortlist" in meta else None
    return Vocabularies(meta["source_lang"], meta["target_lang"], source, target, shortlist)
