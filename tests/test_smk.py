"""logged(): one `snaketrl:` line on the console for any error, the traceback only in the rule's log."""

import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from conftest import ROOT
from snaketrl.errors import DataError
from snaketrl.smk import MAX_INTERNAL_MESSAGE, logged


def fake_snakemake(tmp_path, rule="preprocess"):
    return SimpleNamespace(rule=rule, log=[str(tmp_path / f"{rule}.log")])


def test_user_error_is_one_line_on_the_console_and_in_the_log(tmp_path, capfd):
    smk = fake_snakemake(tmp_path)
    with pytest.raises(SystemExit) as exit_, logged(smk, offline=False):
        print("reading rows")
        raise DataError("dataset 'tldr': data/x.jsonl line 3: column 'completion': expected a non-empty string, "
                        "got null")
    line = ("snaketrl: error in rule preprocess: dataset 'tldr': data/x.jsonl line 3: column 'completion': expected "
            "a non-empty string, got null")
    assert exit_.value.code == 1
    assert capfd.readouterr().err == line + "\n"
    assert open(smk.log[0]).read() == "reading rows\n" + line + "\n"


def test_a_multi_line_user_error_still_reaches_the_console_as_one_line(tmp_path, capfd):
    with pytest.raises(SystemExit), logged(fake_snakemake(tmp_path), offline=False):
        raise DataError("dataset 'x': load failed:\n  404 Not Found\n")
    assert capfd.readouterr().err == "snaketrl: error in rule preprocess: dataset 'x': load failed: 404 Not Found\n"


def test_internal_error_is_one_line_naming_the_log_which_keeps_the_traceback(tmp_path, capfd):
    smk = fake_snakemake(tmp_path, "length_histogram")
    with pytest.raises(SystemExit) as exit_, logged(smk, offline=False):
        "text" + None
    assert exit_.value.code == 1
    assert capfd.readouterr().err == (
        "snaketrl: error in rule length_histogram: internal error: TypeError: can only concatenate str (not "
        f"\"NoneType\") to str (full traceback in {smk.log[0]})\n")
    log = open(smk.log[0]).read()
    assert log.startswith("Traceback (most recent call last):\n") and '"text" + None' in log
    assert log.endswith(f"(full traceback in {smk.log[0]})\n")


def test_a_long_internal_message_is_cut_on_the_console_but_whole_in_the_log(tmp_path, capfd):
    smk = fake_snakemake(tmp_path)
    with pytest.raises(SystemExit), logged(smk, offline=False):
        raise RuntimeError("tensor(\n" + "0.5, " * 200 + ")")
    err = capfd.readouterr().err
    message = err.removeprefix("snaketrl: error in rule preprocess: internal error: ")
    message = message.removesuffix(f" (full traceback in {smk.log[0]})\n")
    assert message.startswith("RuntimeError: tensor( 0.5, 0.5,") and message.endswith(", ...")
    assert len(message) == MAX_INTERNAL_MESSAGE
    assert "0.5, " * 200 in open(smk.log[0]).read()


def test_keyboard_interrupt_propagates(tmp_path):
    with pytest.raises(KeyboardInterrupt), logged(fake_snakemake(tmp_path), offline=False):
        raise KeyboardInterrupt


def test_logging_goes_to_the_log_and_is_restored_after(tmp_path):
    root = logging.getLogger()
    before = root.handlers[:]
    smk = fake_snakemake(tmp_path)
    with logged(smk, offline=False):
        logging.getLogger("snaketrl.test").info("hello from the rule")
    assert root.handlers == before
    assert "snaketrl.test INFO hello from the rule" in open(smk.log[0]).read()


def test_a_rule_script_prints_no_traceback_and_exits_1(tmp_path):
    """As Snakemake runs a script: a fresh interpreter whose stderr is the console."""
    script = textwrap.dedent(f"""
        from types import SimpleNamespace
        from snaketrl.smk import MAX_INTERNAL_MESSAGE, logged
        snakemake = SimpleNamespace(rule="tokenize_prompts", log=[{str(tmp_path / "rule.log")!r}])
        with logged(snakemake):
            {{"input_ids": [1]}}["attention_mask"]
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == ("snaketrl: error in rule tokenize_prompts: internal error: KeyError: 'attention_mask' "
                           f"(full traceback in {tmp_path / 'rule.log'})\n")
    assert "Traceback (most recent call last)" in (tmp_path / "rule.log").read_text()


def test_a_job_goes_offline_even_where_the_hub_libraries_are_imported_already(monkeypatch):
    """A job of the fork server finds huggingface_hub and datasets imported, their offline switches read."""
    import datasets.config
    import huggingface_hub.constants

    from snaketrl.smk import go_offline

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    go_offline()
    assert huggingface_hub.constants.is_offline_mode()
    assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"


def test_a_library_handler_made_before_the_log_opened_writes_into_the_log(tmp_path, capfd):
    """transformers makes its handler at import, on the stderr of that moment; a job of the fork server
    imported it before its log opened, and its warnings still belong in that log."""
    library = logging.getLogger("snaketrl.test_library")
    handler = logging.StreamHandler(sys.__stderr__)
    library.addHandler(handler)
    library.propagate = False
    try:
        smk = fake_snakemake(tmp_path)
        with logged(smk, offline=False):
            library.warning("a library's warning")
        assert handler.stream is sys.__stderr__
    finally:
        library.removeHandler(handler)
    assert "a library's warning" in open(smk.log[0]).read()
    assert "a library's warning" not in capfd.readouterr().err
