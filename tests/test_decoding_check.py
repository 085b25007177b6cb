"""The validation check that chooses a model's fast decoding settings, its record in the checkpoint,
and how --quantize auto / --stop auto read it in `nmt generate`, the API, training and averaging."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import logged_messages, run_cli, tiny_config

import nmt.training.decoding_check as decoding_check_module
import nmt.training.validation as validation_module
from nmt import Translator
from nmt.backends.int8 import Int8Linear
from nmt.backends.torch_backend import TORCH
from nmt.checkpoint.averaging import average as average_checkpoints
from nmt.checkpoint.format import load_checkpoint, model_from_checkpoint, save_checkpoint
from nmt.checkpoint.names import BEST, numbered_checkpoints
from nmt.data.dataset import DataDir
from nmt.data.meta import DatasetMeta
from nmt.data.vocabulary import EOS_ID, Vocabulary
from nmt.device import inference_device
from nmt.device_options import InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.generation.decoding_settings import (
    NO_RECORD,
    RECORD_KEY,
    DecodingSettings,
    decoding_settings,
    read_records,
    resolve_decoding,
    stop_for,
)
from nmt.generation.generate import generate
from nmt.generation.inference import TranslationRequest, inference_model, translate_ids
from nmt.generation.options import GenerateOptions, SearchOptions
from nmt.generation.search import Hypothesis
from nmt.options import build
from nmt.scoring import MetricOptions, score
from nmt.training.decoding_check import (
    CANDIDATES,
    REFERENCE,
    check_averaged,
    check_decoding,
    check_with_training_data,
    choose_decoding,
    timed_check,
)
from nmt.training.trainer import train

INT8_FINISHED, INT8_CURRENT, INT8_EXACT, FP32_FINISHED, FP32_CURRENT = CANDIDATES
REAL_MINIMUM = decoding_check_module.MIN_CHECK_SENTENCES


@pytest.fixture(scope="module", autouse=True)
def checks_on_forty_sentences():
    """The tiny validation split has 40 sentences, fewer than a check needs (the minimum's own test
    puts it back)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoding_check_module, "MIN_CHECK_SENTENCES", 40)
        yield


def average(inputs, output, **count):
    """`nmt average`: the average, then its decoding check."""
    check_averaged(output, average_checkpoints(inputs, output, **count))


FAST = DecodingSettings("int8", "finished", "validation check, 40 sentences: ...")
SEARCH_AT_1_4 = SearchOptions(lenpen=1.4).checked()
CHECKED_AT_1_4 = dataclasses.replace(FAST, search=SEARCH_AT_1_4)  # a check that searched with --lenpen 1.4
SAFE = DecodingSettings("none", "exact", "validation check, 40 sentences: no faster setting kept it")


# -- choosing, given BLEU ------------------------------------------------------------------------------

def test_the_fastest_candidate_that_keeps_bleu_is_chosen_and_slower_ones_are_not_decoded():
    def scored():
        yield INT8_FINISHED, 38.81
        raise AssertionError("a slower candidate was decoded after a faster one kept BLEU")

    choice = choose_decoding(38.95, scored(), 500)
    assert (choice.quantize, choice.stop) == ("int8", "finished")
    assert choice.reason == ("validation check, 500 sentences: fp32 exact 38.95, int8 finished 38.81 BLEU: "
                             "int8 finished kept it (within 0.2)")


def test_a_candidate_that_loses_more_than_the_tolerance_is_passed_over():
    choice = choose_decoding(99.2, [(INT8_FINISHED, 93.3), (INT8_EXACT, 99.0), (FP32_FINISHED, 93.3)], 300)
    assert (choice.quantize, choice.stop) == ("int8", "exact")  # 0.2 below the reference still counts
    choice = choose_decoding(99.2, [(INT8_FINISHED, 93.3), (INT8_EXACT, 98.9), (FP32_FINISHED, 99.3)], 300)
    assert (choice.quantize, choice.stop) == ("none", "finished")


def test_current_is_chosen_where_finished_loses_and_current_keeps_bleu():
    """The figures of a Multi30k model's check at length penalty 1.4 (finished 0.68 below exact search)."""
    choice = choose_decoding(42.03, [(INT8_FINISHED, 41.35), (INT8_CURRENT, 42.04), (INT8_EXACT, 42.03)], 500)
    assert (choice.quantize, choice.stop) == ("int8", "current")
    choice = choose_decoding(42.03, [(INT8_FINISHED, 41.35), (INT8_CURRENT, 41.5), (INT8_EXACT, 41.4),
                                     (FP32_FINISHED, 41.35), (FP32_CURRENT, 42.0)], 500)
    assert (choice.quantize, choice.stop) == ("none", "current")


def test_when_no_candidate_keeps_bleu_the_reference_setting_is_chosen():
    choice = choose_decoding(99.2, [(INT8_FINISHED, 93.3), (INT8_EXACT, 98.9), (FP32_FINISHED, 93.3)], 300)
    assert (choice.quantize, choice.stop) == (REFERENCE.quantize, REFERENCE.stop) == ("none", "exact")
    assert choice.reason.endswith("fp32 finished 93.30 BLEU: no faster setting kept it (within 0.2)")


def test_the_record_is_a_plain_dict_and_a_malformed_one_is_refused():
    assert DecodingSettings.from_dict(CHECKED_AT_1_4.to_dict()) == CHECKED_AT_1_4
    assert DecodingSettings.from_dict({**FAST.to_dict(), "bleu": {"int8 finished": 27.35}}) == FAST  # a later version's
    assert CHECKED_AT_1_4.to_dict() == {"quantize": "int8", "stop": "finished", "reason": FAST.reason,
                                        "search": SEARCH_AT_1_4}
    old = {"quantize": "int8", "stop": "finished", "reason": FAST.reason}  # before records named their search
    assert DecodingSettings.from_dict(old).checked_search() == SearchOptions().checked()
    other_version = DecodingSettings.from_dict({**old, "search": {"beam": 4, "sampling": False}})
    assert other_version.checked_search() != SearchOptions().checked()  # a different search: it never matches
    assert DecodingSettings.from_dict({**old, "stop": "current"}).stop == "current"
    later_rule = DecodingSettings.from_dict({**old, "stop": "sooner"})  # a later version's rule: searched exactly
    assert later_rule.stop == "exact" and later_rule.reason.endswith("; stop sooner is unknown here")
    for bad in ({"quantize": "int4", "stop": "exact", "reason": ""}, {"quantize": "int8"}, "int8",
                {**old, "search": "beam 4"}):
        with pytest.raises(NmtError, match="malformed 'decoding' record"):
            DecodingSettings.from_dict(bad, "x.pt")


# -- resolving auto ------------------------------------------------------------------------------------

def resolve(records, quantize="auto", stop="auto", precision="auto", device="cpu"):
    settings = resolve_decoding(quantize, stop, precision, device, records)
    return settings.quantize, settings.stop, settings.reason


def test_auto_takes_the_record():
    assert resolve({"a.pt": FAST}) == ("int8", "finished", f"auto: {FAST.reason}")
    assert resolve({"a.pt": SAFE})[:2] == ("none", "exact")
    assert resolve({"a.pt": DecodingSettings("int8", "exact", "")})[:2] == ("int8", "exact")


def test_auto_without_a_record_decodes_as_before_and_says_why():
    assert resolve({"a.pt": None}) == ("none", "exact", f"auto: {NO_RECORD.format('the checkpoint')}")
    assert "training's end records one, and `nmt average` of a run's checkpoints" in NO_RECORD


def test_explicit_settings_override_the_record():
    assert resolve({"a.pt": FAST}, quantize="none", stop="exact") == ("none", "exact", "asked for")
    assert resolve({"a.pt": FAST}, quantize="none")[:2] == ("none", "finished")
    assert resolve({"a.pt": FAST}, stop="exact")[:2] == ("int8", "exact")
    assert resolve({"a.pt": FAST}, stop="exact")[2].startswith("--stop exact asked for; auto: validation check")


def test_int8_only_on_the_cpu_and_without_an_explicit_low_precision():
    quantize, stop, reason = resolve({"a.pt": FAST}, device="cuda")
    assert (quantize, stop) == ("none", "finished") and "int8 is for CPU decoding, not cuda" in reason
    quantize, _, reason = resolve({"a.pt": FAST}, precision="bf16")
    assert quantize == "none" and "--precision bf16 asked for" in reason
    assert resolve({"a.pt": FAST}, precision="fp32")[0] == "int8"


def test_an_ensemble_takes_a_fast_setting_only_when_every_model_chose_it():
    int8_exact, fp32_finished = DecodingSettings("int8", "exact", "one"), DecodingSettings("none", "finished", "two")
    assert resolve({"a.pt": FAST, "b.pt": FAST})[:2] == ("int8", "finished")
    quantize, stop, reason = resolve({"a.pt": int8_exact, "b.pt": fp32_finished})
    assert (quantize, stop) == ("none", "exact") and reason == "auto: a.pt: one; b.pt: two"
    assert resolve({"a.pt": FAST, "b.pt": int8_exact})[:2] == ("int8", "exact")
    current = DecodingSettings("int8", "current", "three")
    assert resolve({"a.pt": FAST, "b.pt": current})[:2] == resolve({"a.pt": current, "b.pt": FAST})[:2] == \
        ("int8", "current")
    assert resolve({"a.pt": current, "b.pt": int8_exact})[:2] == ("int8", "exact")
    assert resolve({"a.pt": FAST, "b.pt": None}) == ("none", "exact", f"auto: {NO_RECORD.format('b.pt')}")


def test_an_explicit_int8_with_bf16_is_still_an_error_but_auto_with_bf16_is_not():
    with pytest.raises(NmtError, match="--quantize int8 computes in fp32"):
        InferenceDeviceOptions(quantize="int8", precision="bf16")
    assert InferenceDeviceOptions(precision="bf16").quantize == "auto"


# -- the record in checkpoints, and every surface reading it ----------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny_data_dir, tmp_path_factory):
    """transformer_tiny trained with validation to its end (the check on checkpoint_best.pt included),
    saving every 40 updates for averaging; and the log of that run."""
    save_dir = tmp_path_factory.mktemp("trained")
    with logged_messages() as records:
        train(tiny_config(tiny_data_dir, save_dir, max_update=120, save_interval_updates=40, log_interval=1000))
    return save_dir, records


def with_record(source, path, record: DecodingSettings | None):
    checkpoint = load_checkpoint(source)
    checkpoint.pop(RECORD_KEY, None)
    if record is not None:
        checkpoint[RECORD_KEY] = record.to_dict()
    save_checkpoint(path, checkpoint)
    return path


def test_training_records_the_check_in_checkpoint_best_and_logs_its_choice_and_cost(trained):
    save_dir, log = trained
    record = DecodingSettings.from_dict(load_checkpoint(save_dir / BEST)[RECORD_KEY])
    assert record.reason.startswith("validation check, 40 sentences: fp32 exact ")
    lines = [line for line in log if line.startswith("decoding check of checkpoint_best.pt: ")]
    assert len(lines) == 1
    assert re.search(rf"quantize {record.quantize}, stop {record.stop}, in [\d.]+ s on cpu", lines[0])
    assert RECORD_KEY not in load_checkpoint(save_dir / "checkpoint_last.pt")  # not what users decode


def test_training_can_leave_the_check_out(tiny_data_dir, tmp_path):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=9, check_decoding=False))
    assert RECORD_KEY not in load_checkpoint(tmp_path / BEST)


def test_the_check_measures_the_reference_setting_on_the_validation_sentences(trained, tiny_data_dir):
    """A real check on the tiny model: its reference BLEU is fp32 exact search's on those sentences."""
    checkpoint = load_checkpoint(trained[0] / BEST)
    valid = DataDir.open(tiny_data_dir).split("valid")
    sources, references = [valid.source[i] for i in range(len(valid))], [valid.target[i] for i in range(len(valid))]
    choice = check_decoding(checkpoint, sources, references, torch.device("cpu"))
    model, vocabs = model_from_checkpoint(checkpoint)
    model = inference_model(model, "none", TORCH)  # fp32: the same translations whichever backend
    found = translate_ids(model, sources, TranslationRequest(SearchOptions(stop="exact"), shortlist=vocabs.shortlist))
    (bleu,) = score([vocabs.target.decode(h[0].tokens) for h in found],
                    [[vocabs.target.decode(r) for r in references]], options=MetricOptions(language="de"))
    assert choice.reason.startswith(f"validation check, 40 sentences: fp32 exact {bleu.score:.2f}, int8 finished ")
    assert choice.to_dict() == load_checkpoint(trained[0] / BEST)[RECORD_KEY]  # the same check training ran


def test_averaging_records_the_check_when_the_training_data_is_here(trained, tmp_path, messages):
    output = tmp_path / "averaged.pt"
    average([trained[0]], output, num_update_checkpoints=2)
    record = DecodingSettings.from_dict(load_checkpoint(output)[RECORD_KEY])
    assert record.reason.startswith("validation check, 40 sentences: ")
    assert any(m.startswith(f"decoding check of averaged.pt: quantize {record.quantize}, stop {record.stop}, in ")
               for m in messages)


def test_averaging_logs_why_it_skipped_the_check(trained, tmp_path, messages):
    moved = load_checkpoint(numbered_checkpoints(trained[0], "update")[-1])
    moved["train_config"]["train"]["data"] = str(tmp_path / "gone")
    save_checkpoint(tmp_path / "moved.pt", moved)
    average([tmp_path / "moved.pt"], tmp_path / "averaged.pt")
    assert RECORD_KEY not in load_checkpoint(tmp_path / "averaged.pt")
    assert f"decoding check of averaged.pt skipped: the training's data directory {tmp_path / 'gone'} is not " \
           "here (--quantize auto and --stop auto will decode it with none and exact)" in messages
    del moved["train_config"]
    save_checkpoint(tmp_path / "bare.pt", moved)
    average([tmp_path / "bare.pt"], tmp_path / "bare-averaged.pt")
    assert any("decoding check of bare-averaged.pt skipped: the checkpoints do not name the data directory" in m
               for m in messages)


def test_a_check_that_cannot_run_leaves_the_model_unchecked_with_a_warning(trained, messages):
    assert timed_check(load_checkpoint(trained[0] / BEST), [], [], torch.device("cpu"), "x.pt") is None
    assert any(m.startswith("decoding check of x.pt skipped: the decoding check needs sources and references")
               for m in messages)


def test_a_validation_split_too_small_to_tell_leaves_the_model_unchecked(trained, tmp_path, monkeypatch, messages):
    monkeypatch.setattr(decoding_check_module, "MIN_CHECK_SENTENCES", REAL_MINIMUM)
    average([trained[0]], tmp_path / "averaged.pt", num_update_checkpoints=2)
    assert RECORD_KEY not in load_checkpoint(tmp_path / "averaged.pt")
    assert f"decoding check of averaged.pt skipped: 40 validation sentences, fewer than the {REAL_MINIMUM} the " \
           "check needs to tell 0.2 BLEU from a word or two (--quantize auto and --stop auto will decode it with " \
           "none and exact)" in messages


def test_the_record_round_trips_and_old_checkpoints_have_none(trained, tmp_path):
    path = with_record(trained[0] / BEST, tmp_path / "fast.pt", FAST)
    assert read_records(str(path)) == {str(path): FAST}
    old = with_record(trained[0] / BEST, tmp_path / "old.pt", None)
    assert read_records(f"{path}:{old}") == {str(path): FAST, str(old): None}


def test_generate_decodes_with_the_record_and_logs_it(trained, tiny_data_dir, tmp_path, messages):
    path = with_record(trained[0] / BEST, tmp_path / "fast.pt", FAST)
    values = {"path": [str(path)], "data": str(tiny_data_dir), "split": "valid", "device": "cpu"}
    auto = generate(build(GenerateOptions, {**values, "output": str(tmp_path / "auto.de")}), show_progress=False)
    assert any(m.endswith(f"precision: fp32 (int8 layers compute in fp32); quantize int8, stop finished "
                          f"(auto: {FAST.reason})") for m in messages)
    explicit = generate(build(GenerateOptions, {**values, "quantize": "int8", "stop": "finished",
                                                "output": str(tmp_path / "int8.de")}), show_progress=False)
    assert [t.hypotheses for t in auto.translations] == [t.hypotheses for t in explicit.translations]
    messages.clear()
    generate(build(GenerateOptions, {**values, "quantize": "none", "stop": "exact",
                                     "output": str(tmp_path / "exact.de")}), show_progress=False)
    assert any(m.endswith("; quantize none, stop exact (asked for)") for m in messages)
    assert not any("int8 layers" in m for m in messages)


def test_generate_without_a_record_decodes_as_before(trained, tiny_data_dir, tmp_path, messages):
    path = with_record(trained[0] / BEST, tmp_path / "old.pt", None)
    values = {"path": [str(path)], "data": str(tiny_data_dir), "split": "valid", "device": "cpu"}
    auto = generate(build(GenerateOptions, {**values, "output": str(tmp_path / "auto.de")}), show_progress=False)
    assert any(m.endswith(f"; quantize none, stop exact (auto: {NO_RECORD.format('the checkpoint')})")
               for m in messages)
    exact = generate(build(GenerateOptions, {**values, "quantize": "none", "stop": "exact", "precision": "auto",
                                             "output": str(tmp_path / "exact.de")}), show_progress=False)
    assert [t.hypotheses for t in auto.translations] == [t.hypotheses for t in exact.translations]


def test_the_api_takes_the_record_and_a_call_may_override_it(trained, tmp_path):
    path = with_record(trained[0] / BEST, tmp_path / "fast.pt", FAST)
    translator = Translator.from_checkpoint(path, device="cpu")
    assert translator.decoding == DecodingSettings("int8", "finished", f"auto: {FAST.reason}")
    assert translator.precision == "fp32"
    assert any(isinstance(m, Int8Linear) for m in translator.model.modules())
    assert translator.options()[0].stop == "finished" and translator.options(stop="exact")[0].stop == "exact"
    plain = Translator.from_checkpoint(path, device="cpu", quantize="none")
    assert (plain.decoding.quantize, plain.decoding.stop) == ("none", "finished")
    assert Translator.from_checkpoint(path, device="cpu", quantize=None).decoding.quantize == "none"  # as before auto
    assert translator.options(lenpen=1.0)[0].stop == "exact"  # a search the check did not run


def test_the_api_takes_the_records_stop_rule_for_the_search_its_check_ran(trained, tmp_path):
    """Loading resolves nothing against generate's default search: a model checked at --lenpen 1.4
    is decoded with its check's stop rule by calls at 1.4 (the recipe's), exactly by the others."""
    path = with_record(trained[0] / BEST, tmp_path / "fast.pt", CHECKED_AT_1_4)
    translator = Translator.from_checkpoint(path, device="cpu")
    assert (translator.decoding.quantize, translator.decoding.stop) == ("int8", "finished")
    assert translator.options(lenpen=1.4)[0].stop == "finished"
    assert translator.options()[0].stop == "exact" and translator.options(lenpen=1.4, beam=5)[0].stop == "exact"


def test_auto_with_an_explicit_bf16_keeps_bf16(trained, tmp_path):
    path = with_record(trained[0] / BEST, tmp_path / "fast.pt", FAST)
    settings = decoding_settings(InferenceDeviceOptions(device="cpu", precision="bf16"), SearchOptions(), str(path))
    assert settings == DecodingSettings("none", "finished", f"--precision bf16 asked for; auto: {FAST.reason}")
    assert inference_device(InferenceDeviceOptions(device="cpu", precision="bf16", quantize=settings.quantize))[1] \
        == "bf16"


def test_training_validation_bleu_searches_exactly_whatever_the_defaults(tiny_data_dir, tmp_path, monkeypatch):
    searched = []

    def spy(model, sources, request, *args, **kwargs):
        searched.append(request.search.stop)
        return translate_ids(model, sources, request, *args, **kwargs)

    monkeypatch.setattr(validation_module, "translate_ids", spy)
    train(tiny_config(tiny_data_dir, tmp_path, max_update=9, eval_bleu=True, check_decoding=False))
    assert searched and set(searched) == {"exact"}


def test_the_defaults_are_auto():
    assert SearchOptions().stop == "auto" and InferenceDeviceOptions().quantize == "auto"
    assert [setting.name() for setting in CANDIDATES] == ["int8 finished", "int8 current", "int8 exact",
                                                          "fp32 finished", "fp32 current"]



def test_the_records_stop_rule_holds_only_for_the_search_the_check_ran():
    """The check compared finished with exact search at generate's beam, length penalty and limits;
    another length penalty or beam changes when finished search gives up, so auto is exact there."""
    checked = DecodingSettings("int8", "finished", "auto: validation check")
    assert stop_for(SearchOptions(), checked) == "finished"
    assert stop_for(SearchOptions(lenpen=1.0), checked) == "exact"
    assert stop_for(SearchOptions(beam=8), checked) == "exact"
    assert stop_for(SearchOptions(lenpen_style="fairseq"), checked) == "exact"
    assert stop_for(SearchOptions(nbest=2), checked) == "finished"  # what is returned, not how the search ends
    assert stop_for(SearchOptions(stop="exact"), checked) == "exact"
    assert stop_for(SearchOptions(stop="finished"), DecodingSettings("none", "exact", "")) == "finished"


@pytest.mark.parametrize("auto_precision", ["fp32", "bf16"])
def test_the_check_decodes_each_setting_as_named(trained, tiny_data_dir, monkeypatch, auto_precision):
    """The reference and every candidate are decoded with their own quantization and stop rule, fastest
    candidate first (each losing here, so all four are decoded); the reference and int8 in fp32, the
    others in the precision `auto` gives on the device, as `nmt generate` will decode them."""
    checkpoint = load_checkpoint(trained[0] / BEST)
    valid = DataDir.open(tiny_data_dir).split("valid")
    sources, references = [valid.source[i] for i in range(len(valid))], [valid.target[i] for i in range(len(valid))]
    decoded, real = [], decoding_check_module.translate_ids

    def spy(model, sources, request, *args, **kwargs):
        int8 = any(isinstance(m, Int8Linear) for m in model.modules())
        decoded.append(("int8" if int8 else "none", request.search.stop, request.precision))
        return real(model, sources, request, *args, **kwargs)

    scores = iter([30.0, 20.0, 20.0, 20.0, 20.0, 20.0])  # the reference, then candidates that lose 10 BLEU
    monkeypatch.setattr(decoding_check_module, "translate_ids", spy)
    monkeypatch.setattr(decoding_check_module, "score", lambda *a, **k: [type("B", (), {"score": next(scores)})()])
    monkeypatch.setattr(decoding_check_module, "resolve_precision", lambda precision, device: (auto_precision, ""))
    choice = check_decoding(checkpoint, sources, references, torch.device("cpu"))
    other = auto_precision
    assert decoded == [("none", "exact", "fp32"), ("int8", "finished", "fp32"), ("int8", "current", "fp32"),
                       ("int8", "exact", "fp32"), ("none", "finished", other), ("none", "current", other)]
    assert (choice.quantize, choice.stop) == ("none", "exact")
    assert f"fp32 exact 30.00, int8 finished 20.00, int8 current 20.00, int8 exact 20.00, {other} finished 20.00, " \
           f"{other} current 20.00 BLEU: no faster setting kept it" in choice.reason
    decoded.clear()
    scores = iter([30.0, 20.0, 20.0, 20.0])
    choice = check_decoding(checkpoint, sources, references, torch.device("cpu"), SearchOptions(lenpen=0.0))
    assert decoded == [("none", "exact", "fp32"), ("int8", "finished", "fp32"), ("int8", "exact", "fp32"),
                       ("none", "finished", other)]
    assert (choice.quantize, choice.stop) == ("none", "exact")  # without a length penalty current is exact


def test_a_search_the_check_did_not_run_is_exact_and_the_reason_says_so(trained, tmp_path):
    path = with_record(trained[0] / BEST, tmp_path / "fast.pt", FAST)
    settings = decoding_settings(InferenceDeviceOptions(device="cpu"), SearchOptions(lenpen=1.0), str(path))
    assert (settings.quantize, settings.stop) == ("int8", "exact")
    assert settings.reason.endswith("; stop exact: this search has --lenpen 1.0 (the check's: 0.6); with the "
                                    "check's, stop finished (or have `nmt average` check this search: --check-beam, "
                                    "--check-lenpen, ...)")
    settings = decoding_settings(InferenceDeviceOptions(device="cpu"), SearchOptions(lenpen=1.0, beam=5), str(path))
    assert "this search has --beam 5 (the check's: 4), --lenpen 1.0 (the check's: 0.6);" in settings.reason
    other_version = with_record(trained[0] / BEST, tmp_path / "other.pt", dataclasses.replace(
        FAST, search={**SearchOptions().checked(), "some_later_option": 2}))
    settings = decoding_settings(InferenceDeviceOptions(device="cpu"), SearchOptions(), str(other_version))
    assert settings.stop == "exact"
    assert "stop exact: the check ran another version's search (--beam 4 " in settings.reason


def test_the_records_stop_rule_holds_for_the_search_its_check_named():
    assert stop_for(SearchOptions(lenpen=1.4), CHECKED_AT_1_4) == "finished"
    assert stop_for(SearchOptions(), CHECKED_AT_1_4) == "exact"  # generate's defaults: not what was checked
    assert stop_for(SearchOptions(lenpen=1.4, beam=5), CHECKED_AT_1_4) == "exact"


def test_generate_takes_the_choice_of_a_check_that_ran_its_search(trained, tmp_path):
    path = with_record(trained[0] / BEST, tmp_path / "fast.pt", CHECKED_AT_1_4)
    settings = decoding_settings(InferenceDeviceOptions(device="cpu"), SearchOptions(lenpen=1.4), str(path))
    assert settings == DecodingSettings("int8", "finished", f"auto: {FAST.reason}", SEARCH_AT_1_4)


def test_an_ensemble_whose_checks_ran_different_searches_searches_exactly():
    settings = resolve_decoding("auto", "auto", "auto", "cpu", {"a.pt": FAST, "b.pt": CHECKED_AT_1_4})
    assert (settings.quantize, settings.stop) == ("int8", "exact")
    assert "stop exact: the models' checks ran different searches" in settings.reason


def test_average_checks_the_search_its_options_name_and_records_it(trained, tmp_path, monkeypatch, capsys):
    decoded = []
    real = decoding_check_module.translate_ids

    def spy(model, sources, request, *args, **kwargs):
        decoded.append(request.search)
        return real(model, sources, request, *args, **kwargs)

    monkeypatch.setattr(decoding_check_module, "translate_ids", spy)
    output = tmp_path / "averaged.pt"
    code, _, err = run_cli(monkeypatch, capsys, "average", trained[0], "--num-update-checkpoints", "2", "-o", output,
                           "--check-beam", "2", "--check-lenpen", "1.4", "--check-max-len-a", "0.5",
                           "--check-max-len-b", "7")
    assert code == 0, err
    asked = {"beam": 2, "lenpen": 1.4, "max_len_a": 0.5, "max_len_b": 7}
    assert decoded and all({name: getattr(search, name) for name in asked} == asked for search in decoded)
    record = DecodingSettings.from_dict(load_checkpoint(output)[RECORD_KEY])
    assert record.search == {**asked, "lenpen_style": "gnmt", "min_len": 1}
    assert "searching with --beam 2 --lenpen 1.4 --lenpen-style gnmt --max-len-a 0.5 --max-len-b 7 --min-len 1 (" \
        in " ".join(err.split()), err
    code, _, err = run_cli(monkeypatch, capsys, "average", trained[0], "--num-update-checkpoints", "2", "-o", output,
                           "--check-beam", "0")
    assert code != 0 and err.strip() == "error: --check-beam must be at least 1, got 0"


def test_training_checks_the_search_its_config_names(tiny_data_dir, tmp_path):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=9, check_lenpen=1.4))
    record = DecodingSettings.from_dict(load_checkpoint(tmp_path / BEST)[RECORD_KEY])
    assert record.search == SEARCH_AT_1_4


# -- which settings and sentences the check decodes ------------------------------------------------------

def spy_on_decoding(monkeypatch) -> list[tuple[str, str, list[list[int]]]]:
    """Each decoding of the check as (quantize, stop, its sources), without decoding: every output is
    "EOS" and every BLEU 20 (so no candidate loses and only the fastest is decoded after the reference)."""
    decoded = []

    def translate(model, sources, request, *args, **kwargs):
        int8 = any(isinstance(m, Int8Linear) for m in model.modules())
        decoded.append(("int8" if int8 else "none", request.search.stop, [list(map(int, s)) for s in sources]))
        return [[Hypothesis([EOS_ID], 0.0)] for _ in sources]

    monkeypatch.setattr(decoding_check_module, "translate_ids", translate)
    monkeypatch.setattr(decoding_check_module, "score", lambda *a, **k: [type("B", (), {"score": 20.0})()])
    return decoded


def test_off_the_cpu_the_check_never_tries_int8(untrained_checkpoint, monkeypatch):
    """int8 is for CPU decoding: on a GPU (here "meta", another device than the CPU) the check decodes
    fp32 only, chooses among fp32's settings and says why."""
    decoded = spy_on_decoding(monkeypatch)
    sources = [np.asarray([5, EOS_ID])] * 40
    checkpoint = load_checkpoint(untrained_checkpoint)
    choice = check_decoding(checkpoint, sources, sources, torch.device("meta"))
    assert [(quantize, stop) for quantize, stop, _ in decoded] == [("none", "exact"), ("none", "finished")]
    assert (choice.quantize, choice.stop) == ("none", "finished")
    assert choice.reason.endswith("; int8 not tried on meta")
    decoded.clear()
    assert check_decoding(checkpoint, sources, sources, torch.device("cpu")).quantize == "int8"  # where it is tried
    assert [(quantize, stop) for quantize, stop, _ in decoded] == [("none", "exact"), ("int8", "finished")]


def test_the_check_takes_every_validation_source_that_fits_the_model(untrained_checkpoint, tiny_data_dir,
                                                                     monkeypatch):
    """A source of exactly max_positions tokens (EOS included) fits the model and is checked; a longer
    one is left out."""
    monkeypatch.setattr(decoding_check_module, "MIN_CHECK_SENTENCES", 1)
    decoded = spy_on_decoding(monkeypatch)
    valid = DataDir.open(tiny_data_dir).split("valid")
    sources = [list(map(int, valid.source[i])) for i in range(len(valid))]
    longest = sorted(len(source) for source in sources)[len(sources) // 2]
    assert any(len(s) == longest for s in sources) and any(len(s) > longest for s in sources)
    checkpoint = load_checkpoint(untrained_checkpoint)
    checkpoint["model_config"]["max_positions"] = longest
    checkpoint["train_config"] = {"train": {"data": str(tiny_data_dir), "valid_subset": "valid"}}
    choice = check_with_training_data(checkpoint, checkpoint["train_config"], "model.pt")
    fitting = [source for source in sources if len(source) <= longest]
    assert decoded[0][2] == fitting
    assert choice.reason.startswith(f"validation check, {len(fitting)} sentences: ")


@pytest.mark.parametrize("side", ["en", "de"])
def test_the_check_is_skipped_where_the_data_directory_holds_another_vocabulary(untrained_checkpoint, tiny_data_dir,
                                                                                tmp_path, side, monkeypatch,
                                                                                messages):
    """Token ids of another source or target vocabulary would be nonsense to the model: no check."""
    decoded = spy_on_decoding(monkeypatch)
    data = Path(shutil.copytree(tiny_data_dir, tmp_path / "data"))
    Vocabulary.train([f"{word} {word}s" for word in ("zwei", "drei", "vier", "five", "six")] * 20,
                     vocab_size=40).save(data / "other.model")
    meta = DatasetMeta.load(data)
    dataclasses.replace(meta, vocab_files={**meta.vocab_files, side: "other.model"}).save(data)
    checkpoint = load_checkpoint(untrained_checkpoint)
    train_config = {"train": {"data": str(data), "valid_subset": "valid"}}
    assert check_with_training_data(checkpoint, train_config, "model.pt") is None and decoded == []
    assert f"decoding check of model.pt skipped: {data} now holds other vocabularies than the checkpoints' " \
           "(--quantize auto and --stop auto will decode it with none and exact)" in messages
