"""nmt export ctranslate2 and generate --engine ctranslate2: the same model, the same outputs."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
import torch
from conftest import needs_ct2, numbers_pairs, train_tiny_checkpoint

from nmt.checkpoint.format import Vocabularies, load_checkpoint, model_state, save_checkpoint
from nmt.cli import main
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID, Vocabulary
from nmt.errors import NmtError
from nmt.export.ctranslate2 import export_ctranslate2
from nmt.export.options import ExportOptions
from nmt.generation.generate import generate
from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids
from nmt.generation.options import GenerateOptions
from nmt.models.registry import build_model, get_arch, resolve_config
from nmt.options import build


@pytest.fixture(scope="module")
def trained(tiny_data_dir, tmp_path_factory):
    """transformer_tiny after 120 updates on the numbers task (a few seconds)."""
    return train_tiny_checkpoint(tiny_data_dir, tmp_path_factory.mktemp("ct2-train"))


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    return export_ctranslate2(ExportOptions(str(trained), str(tmp_path_factory.mktemp("ct2") / "model")))


@pytest.fixture(scope="module")
def sources(trained) -> list[np.ndarray]:
    _, vocabs = prepare_model(trained, torch.device("cpu"))
    return [np.asarray(ids + [EOS_ID]) for ids in vocabs.source.encode_batch([s for s, _ in numbers_pairs(80, 11)])]


def options_of_generate(**values) -> GenerateOptions:
    return build(GenerateOptions, {"input": "-", **values})


def ct2_hypotheses(exported, sources, options):
    from nmt.generation.ctranslate2_engine import open_translator, translate_ids_ctranslate2

    translator, vocabs, max_positions = open_translator(exported, torch.device("cpu"), "default",
                                                        options.batching.workers)
    assert translator.num_translators == (options.batching.workers or 1)  # CTranslate2's inter_threads
    return translate_ids_ctranslate2(translator, vocabs, sources, options, max_positions=max_positions)


@needs_ct2
@pytest.mark.parametrize("beam,workers", [(1, 1), (4, 1), (4, 2)])
def test_greedy_and_beam_outputs_equal_nmts_own(trained, exported, sources, beam, workers):
    options = options_of_generate(beam=beam, lenpen=0.0, max_tokens=2000, stop="exact")  # alpha 0: CTranslate2's rule
    model, _ = prepare_model(trained, torch.device("cpu"))
    ours = [hyps[0].tokens for hyps in translate_ids(model, sources,
                                                     TranslationRequest(options.search, options.batching))]
    # workers: several batches at once on both sides (CTranslate2's inter_threads)
    parallel = options_of_generate(beam=beam, lenpen=0.0, max_tokens=200, workers=workers, stop="exact")
    theirs = [hyps[0].tokens for hyps in ct2_hypotheses(exported, sources, parallel)]
    assert len(set(map(tuple, ours))) > 20  # varied translations, not one degenerate output
    assert theirs == ours
    found = translate_ids(model, sources, TranslationRequest(parallel.search, parallel.batching))
    assert [hyps[0].tokens for hyps in found] == ours


@needs_ct2
@pytest.mark.parametrize("overrides", [{"normalize_before": True}, {"share_embeddings": "decoder"},
                                       {"share_embeddings": "none", "normalize_before": True}])
def test_every_variant_gives_nmts_log_probabilities(overrides, tmp_path):
    """Pre-norm (joint vocabulary), separate vocabularies, untied output projection: teacher-forced log-probabilities of
    every token through CTranslate2 equal nmt's. Every weight is perturbed, so that no layer norm is the
    identity and no bias zero: a weight exported to the wrong place changes the numbers."""
    from nmt.generation.ctranslate2_engine import open_translator

    pairs = numbers_pairs(200, 2)
    source = Vocabulary.train([s for s, _ in pairs], vocab_size=100)
    target = Vocabulary.train([t for _, t in pairs], vocab_size=110) if "share_embeddings" in overrides else source
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, overrides)
    torch.manual_seed(0)
    model = build_model(arch.model_name, config, len(source), len(target), PAD_ID).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    path = tmp_path / "model.pt"
    save_checkpoint(path, model_state(model, arch.name, config, Vocabularies("en", "de", source, target)))
    translator, vocabs, _ = open_translator(export_ctranslate2(ExportOptions(str(path), str(tmp_path / "ct2"))),
                                            torch.device("cpu"), "default")
    assert vocabs.source == source and vocabs.target == target
    for source_text, target_text in pairs[:5]:
        source_ids, target_ids = source.encode(source_text), target.encode(target_text) + [EOS_ID]
        theirs = translator.score_batch([[source.piece(i) for i in source_ids]],
                                        [[target.piece(i) for i in target_ids[:-1]]])[0].log_probs
        with torch.inference_mode():
            logits = model(torch.tensor([source_ids + [EOS_ID]]), torch.tensor([[BOS_ID] + target_ids[:-1]]))[0]
        ours = logits.log_softmax(-1)[torch.arange(len(target_ids)), torch.tensor(target_ids)]
        assert theirs == pytest.approx(ours.tolist(), abs=1e-3)


@needs_ct2
def test_scores_are_log_probabilities_over_length_to_the_alpha(trained, exported, sources):
    """fairseq's length penalty, |Y| counting EOS; the P- scores are each token's log-probability."""
    options = options_of_generate(beam=4, nbest=2, lenpen=1.0, lenpen_style="fairseq", format="fairseq")
    model, _ = prepare_model(trained, torch.device("cpu"))
    for source, hyps in zip(sources[:20], ct2_hypotheses(exported, sources[:20], options)):
        assert len(hyps) == 2 and hyps[0].score >= hyps[1].score
        for hyp in hyps:
            with torch.inference_mode():
                prev = torch.tensor([[BOS_ID] + hyp.tokens[:-1]])
                logprobs = model(torch.as_tensor(source)[None], prev)[0].log_softmax(-1)
            ours = logprobs[torch.arange(len(hyp.tokens)), torch.tensor(hyp.tokens)]
            assert hyp.tokens[-1] == EOS_ID and len(hyp.positional_scores) == len(hyp.tokens)
            assert hyp.score == pytest.approx(float(ours.sum()) / len(hyp.tokens), abs=2e-3)
            assert hyp.positional_scores == pytest.approx(ours.tolist(), abs=2e-3)


@needs_ct2
def test_max_length_is_per_sentence(exported, sources):
    options = options_of_generate(beam=2, lenpen=0.0, max_len_a=0.5, max_len_b=1)
    hypotheses = ct2_hypotheses(exported, sources, options)
    limits = [int(0.5 * (len(s) - 1) + 1) for s in sources]
    assert all(len(hyps[0].tokens) - 1 <= limit for hyps, limit in zip(hypotheses, limits))
    assert max(len(hyps[0].tokens) - 1 for hyps in hypotheses) > min(limits)  # not the batch's shortest limit


@needs_ct2
def test_sampling_gives_nbest_samples_and_follows_the_seed(exported, sources):
    from nmt.generation.ctranslate2_engine import load_ctranslate2

    options = options_of_generate(path=[str(exported)], engine="ctranslate2", beam=3, nbest=3, sampling=True, topk=10,
                                  lenpen=0.0, seed=4)

    def samples(translate) -> list[list[list[int]]]:
        return [[h.tokens for h in hyps] for hyps in translate(sources[:10], None)]

    translate, _ = load_ctranslate2(options, torch.device("cpu"))
    first = translate(sources[:10], None)
    assert all(len(hyps) == 3 and [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
               for hyps in first)
    assert samples(translate) != [[h.tokens for h in hyps] for hyps in first]  # a second batch draws on (a stream)
    assert samples(load_ctranslate2(options, torch.device("cpu"))[0]) == [[h.tokens for h in hyps] for hyps in first]


def run_cli(monkeypatch, capsys, *args: str, stdin: str = "") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["nmt", *args])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8"))))
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@needs_ct2
def test_cli_int8_export_loads_and_translates(trained, exported, tmp_path, monkeypatch, capsys):
    outdir = tmp_path / "int8"
    code, _, err = run_cli(monkeypatch, capsys, "export", "ctranslate2", str(trained), str(outdir),
                           "--quantization", "int8")
    assert code in (0, None), err
    assert {"model.bin", "shared_vocabulary.json", "sentencepiece.model", "nmt.json"} <= \
        {p.name for p in outdir.iterdir()}
    assert (outdir / "model.bin").stat().st_size < 0.5 * (exported / "model.bin").stat().st_size
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", "-", "--path", str(outdir), "--engine",
                             "ctranslate2", "--lenpen", "0", stdin="five\n\nI counted to nine yesterday.\n")
    assert code in (0, None), err
    lines = out.split("\n")[:-1]
    assert len(lines) == 3 and lines[1] == "" and "gezählt" in lines[2]
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-i", "-", "--path", str(outdir), stdin="five\n")
    assert code == 1 and err == f"error: {outdir} is a CTranslate2 model directory: decode it with --engine " \
                                "ctranslate2\n"


@needs_ct2
def test_cli_generate_from_a_checkpoint_equals_nmts_output(trained, monkeypatch, capsys):
    text = "".join(s + "\n" for s, _ in numbers_pairs(15, 3))
    outputs = [run_cli(monkeypatch, capsys, "generate", "-i", "-", "--path", str(trained), "--lenpen", "0",
                       "--precision", "fp32", "--engine", engine, stdin=text)[1] for engine in ("nmt", "ctranslate2")]
    assert len(outputs[0].splitlines()) == 15 and outputs[1] == outputs[0]


@needs_ct2
def test_only_an_earlier_export_is_replaced_and_only_with_force(trained, tmp_path):
    outdir = tmp_path / "model"
    outdir.mkdir()
    (outdir / "mine.txt").write_text("keep me")
    for force in (False, True):  # --force only replaces an earlier export
        with pytest.raises(NmtError, match="is not an export of `nmt export ctranslate2`"):
            export_ctranslate2(ExportOptions(str(trained), str(outdir), force=force))
    assert [p.name for p in outdir.iterdir()] == ["mine.txt"] and (outdir / "mine.txt").read_text() == "keep me"
    (outdir / "mine.txt").unlink()
    export_ctranslate2(ExportOptions(str(trained), str(outdir)))  # an empty directory is used
    with pytest.raises(NmtError, match="already exists: use --force"):
        export_ctranslate2(ExportOptions(str(trained), str(outdir)))
    (outdir / "model.pt").write_bytes(trained.read_bytes())
    with pytest.raises(NmtError, match="holds the checkpoint"):  # replacing the export would delete it
        export_ctranslate2(ExportOptions(str(outdir / "model.pt"), str(outdir), force=True))
    (outdir / "model.pt").unlink()
    (outdir / "extra.txt").write_text("x")
    export_ctranslate2(ExportOptions(str(trained), str(outdir), force=True))
    assert (outdir / "model.bin").is_file() and not (outdir / "extra.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no work directory left behind


@needs_ct2
def test_an_architecture_ctranslate2_cannot_express_is_a_clear_error(trained, tmp_path, monkeypatch, capsys):
    checkpoint = load_checkpoint(trained)
    checkpoint["model_name"] = "lstm"
    path = tmp_path / "lstm.pt"
    save_checkpoint(path, checkpoint)
    code, _, err = run_cli(monkeypatch, capsys, "export", "ctranslate2", str(path), str(tmp_path / "out"))
    assert code == 1 and err == "error: cannot export model 'lstm' (arch 'transformer_tiny') to CTranslate2: " \
                                "only transformer is supported\n"
    assert not (tmp_path / "out").exists()


@needs_ct2
def test_the_default_gnmt_length_penalty_decodes_as_fairseqs_with_one_warning(trained, tmp_path, caplog):
    """CTranslate2 has only |Y|^alpha: the default (gnmt) is switched, not refused on every call."""
    source = tmp_path / "in.en"
    source.write_text("twenty-one\nthree hundred\n")
    common = {"path": [str(trained)], "engine": "ctranslate2", "input": str(source)}
    gnmt = generate(build(GenerateOptions, common), show_progress=False)
    fairseq = generate(build(GenerateOptions, {**common, "lenpen_style": "fairseq"}), show_progress=False)
    assert [t.hypotheses[0].tokens for t in gnmt.translations] == [t.hypotheses[0].tokens for t in fairseq.translations]
    warnings = [r.getMessage() for r in caplog.records if "no GNMT length penalty" in r.getMessage()]
    assert len(warnings) == 1 and "|Y|^0.6" in warnings[0]


def test_exact_search_asked_of_ctranslate2_is_a_warning_where_it_could_differ(trained, messages):
    from nmt.generation.ctranslate2_engine import ctranslate2_search

    for stop, lenpen, nbest in (("exact", 0.6, 1), ("exact", 0.0, 1), ("exact", 0.0, 2), ("auto", 0.6, 1),
                                ("finished", 0.6, 1)):
        ctranslate2_search(options_of_generate(path=[str(trained)], engine="ctranslate2", stop=stop, lenpen=lenpen,
                                               nbest=nbest))
    assert [m for m in messages if "--stop" in m] == 2 * [
        "--engine ctranslate2 ends a sentence once --beam hypotheses have finished (--stop finished); with a length "
        "penalty or --nbest > 1, --stop exact can find other translations: --engine nmt searches so"]


def test_missing_ctranslate2_is_a_one_line_hint(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import fails as if not installed
    code, _, err = run_cli(monkeypatch, capsys, "export", "ctranslate2", str(trained), str(tmp_path / "out"))
    assert code == 1 and err == "error: CTranslate2 is not installed: pip install -e '.[ct2]' in nmt's checkout\n"


@needs_ct2
def test_outputs_end_before_the_models_last_position_as_in_nmts_own_search(tmp_path):
    from test_translator import tiny_checkpoint

    from nmt.generation.ctranslate2_engine import load_ctranslate2

    vocab = Vocabulary.train([side for pair in numbers_pairs(300, seed=1) for side in pair], vocab_size=120)
    checkpoint = tiny_checkpoint(tmp_path / "short.pt", vocab, max_positions=16)
    export_ctranslate2(ExportOptions(str(checkpoint), str(tmp_path / "ct2")))
    options = options_of_generate(path=[str(tmp_path / "ct2")], engine="ctranslate2", beam=1, lenpen=0.0,
                                  lenpen_style="fairseq", min_len=40, max_len_b=100)
    translate, _ = load_ctranslate2(options, torch.device("cpu"))
    source = [np.asarray(vocab.encode("five") + [EOS_ID])]
    (hypotheses,) = translate(source, None)  # CTranslate2 refused position 16 before the cap
    model, _ = prepare_model(str(checkpoint), torch.device("cpu"))
    (ours,) = translate_ids(model, source, TranslationRequest(options.search, options.batching))
    assert len(ours[0].tokens) == 16 and len(hypotheses[0].tokens) == 16  # 15 tokens and EOS, as nmt's own


def test_by_default_ctranslate2_decodes_one_batch_per_thread_on_a_cpu(exported, monkeypatch):
    """As nmt's own decoder: --workers unset is CTranslate2's inter_threads = torch's threads there,
    one intra-op thread each; sampling keeps one."""
    import nmt.generation.ctranslate2_engine as engine
    from nmt.generation.ctranslate2_engine import load_ctranslate2

    opened = []
    real_open = engine.open_translator

    def open_translator(path, device, compute, workers):
        opened.append(workers)
        return real_open(path, device, compute, workers)

    monkeypatch.setattr(engine, "open_translator", open_translator)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    load_ctranslate2(options_of_generate(path=[str(exported)], engine="ctranslate2"), torch.device("cpu"))
    load_ctranslate2(options_of_generate(path=[str(exported)], engine="ctranslate2", workers=1), torch.device("cpu"))
    load_ctranslate2(options_of_generate(path=[str(exported)], engine="ctranslate2", sampling=True),
                     torch.device("cpu"))
    assert opened == [3, 1, 1]


class RecordingTranslator:
    """A CTranslate2 translator that records the keyword arguments and sizes of its translate_batch calls."""

    def __init__(self, translator):
        self.translator, self.calls = translator, []

    def __getattr__(self, name):
        return getattr(self.translator, name)

    def translate_batch(self, source, target_prefix=None, **options):
        self.calls.append({"sentences": len(source), **options})
        return self.translator.translate_batch(source, target_prefix, **options)


def controls_for(vocabs, count: int):
    """Every fifth sentence starts with a prefix, every third bans a word (so the bans differ between sentences)."""
    from nmt.generation.constraints import SentenceControls

    ban = vocabs.target.encode("hundert")
    return [SentenceControls(prefix=vocabs.target.encode("drei") if i % 5 == 0 else [],
                             bans=[ban] if i % 3 == 0 else []) or None for i in range(count)]


@needs_ct2
def test_batching_and_workers_never_change_the_outputs(exported, sources):
    """Whatever the batches and workers, each sentence gets what CTranslate2 gives it alone (a batch of one,
    the way the engine called it before it let CTranslate2 batch), prefixes and its own bans included,
    in the input's order."""
    from nmt.generation.ctranslate2_engine import open_translator, translate_ids_ctranslate2

    translator, vocabs, max_positions = open_translator(exported, torch.device("cpu"), "default")
    sources = sources[:30] + [np.asarray([EOS_ID])]  # and an empty line, answered at once
    controls = controls_for(vocabs, len(sources) - 1) + [None]
    search = dict(beam=4, nbest=2, lenpen=0.6, lenpen_style="fairseq", format="fairseq")
    piece = vocabs.target.piece
    alone = []
    for source, control in zip(sources[:-1], controls):
        limit = len(source) - 1 + 200  # the default max length rule, a = 1, b = 200
        (result,) = translator.translate_batch(
            [[vocabs.source.piece(i) for i in source[:-1]]], [[piece(i) for i in control.prefix]]
            if control and control.prefix else None, beam_size=4, num_hypotheses=2, length_penalty=0.6,
            max_decoding_length=limit, suppress_sequences=[[piece(i) for i in ban] for ban in control.bans]
            if control and control.bans else None, max_input_length=0, return_scores=True, return_end_token=True)
        ids = [[vocabs.target.processor.piece_to_id(t) for t in tokens] for tokens in result.hypotheses]
        alone.append([hyp if hyp[-1] == EOS_ID else hyp + [EOS_ID] for hyp in ids])
    for batching in ({}, {"batch_size": 1, "max_tokens": None}, {"batch_size": 3, "max_tokens": 300},
                     {"max_tokens": 40}, {"workers": 2}, {"workers": 3, "max_tokens": 100000}):
        options = options_of_generate(**search, **batching, max_len_b=200)
        translator, vocabs, max_positions = open_translator(exported, torch.device("cpu"), "default",
                                                            options.batching.workers)
        hypotheses = translate_ids_ctranslate2(translator, vocabs, sources, options, max_positions=max_positions,
                                               controls=controls)
        assert [[h.tokens for h in hyps] for hyps in hypotheses[:-1]] == alone, batching
        assert all(h.tokens[-1] == EOS_ID and len(h.positional_scores) == len(h.tokens)
                   for hyps in hypotheses for h in hyps)
        assert [h.tokens for h in hypotheses[-1]] == [[EOS_ID]] * 2
    assert alone[0][0][:len(controls[0].prefix)] == controls[0].prefix  # the prefix was kept


@needs_ct2
def test_ctranslate2_cuts_its_own_batches_of_one_max_length(exported, sources):
    """One asynchronous call per max length (and list of bans): CTranslate2's own batches, by tokens. The
    default on a CPU is its best (CPU_BATCH_TOKENS); --max-tokens is shared as by nmt's decoder (source tokens x
    beam, among the workers); --batch-size alone is sentences; with --max-tokens it caps each call."""
    from nmt.generation.ctranslate2_engine import CPU_BATCH_TOKENS, open_translator, translate_ids_ctranslate2

    lengths = {len(s) for s in sources}

    def calls(**batching) -> list[dict]:
        options = options_of_generate(beam=4, lenpen=0.0, **batching)
        translator, vocabs, max_positions = open_translator(exported, torch.device("cpu"), "default",
                                                            options.batching.workers)
        recorder = RecordingTranslator(translator)
        translate_ids_ctranslate2(recorder, vocabs, sources, options, max_positions=max_positions)
        assert all(call["asynchronous"] for call in recorder.calls)
        return recorder.calls

    default = calls()
    assert len(default) == len(lengths) and sum(c["sentences"] for c in default) == len(sources)  # max len a = 1
    assert len({c["max_decoding_length"] for c in default}) == len(lengths)
    assert {(c["max_batch_size"], c["batch_type"]) for c in default} == {(CPU_BATCH_TOKENS, "tokens")}
    assert {(c["max_batch_size"], c["batch_type"]) for c in calls(max_tokens=2000, workers=2)} == {(250, "tokens")}
    assert {(c["max_batch_size"], c["batch_type"]) for c in calls(batch_size=8, max_tokens=None)} == {(8, "examples")}
    capped = calls(batch_size=3, max_tokens=2000)
    assert max(c["sentences"] for c in capped) == 3 and sum(c["sentences"] for c in capped) == len(sources)


@needs_ct2
def test_the_threads_go_to_inter_threads_as_ctranslate2_advises(exported, monkeypatch):
    """--workers unset on a CPU: inter_threads = the threads, one intra-op thread each (CTranslate2's docs: prefer
    inter_threads to intra_threads, their product at most the cores); --workers 1: one translator, all threads."""
    import ctranslate2

    from nmt.generation.ctranslate2_engine import load_ctranslate2

    made = []
    real = ctranslate2.Translator

    def translator(*args, **kwargs):
        made.append({k: kwargs[k] for k in ("inter_threads", "intra_threads", "max_queued_batches")})
        return real(*args, **kwargs)

    monkeypatch.setattr(ctranslate2, "Translator", translator)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for workers in (None, 1, 2):
        load_ctranslate2(options_of_generate(path=[str(exported)], engine="ctranslate2", workers=workers),
                         torch.device("cpu"))
    assert made == [{"inter_threads": 2, "intra_threads": 1, "max_queued_batches": -1},
                    {"inter_threads": 1, "intra_threads": 2, "max_queued_batches": -1},
                    {"inter_threads": 2, "intra_threads": 1, "max_queued_batches": -1}]
