"""The tests' Snakemake command line (tests/snakemake_cli.py) answers as `python -m snakemake` does."""

import os
import re
import subprocess
import sys
import time

import psutil
import pytest
import snakemake_cli

SNAKEFILE = """
import os, sys
rule all:
    input: "out.txt"
rule write:
    output: "out.txt"
    params: flag=os.environ["SNAKETRL_TEST_FLAG"], found=sys.modules["shadowed"].VALUE
    shell: "echo {params.flag} {params.found} > {output}"
"""


def test_a_command_answers_as_a_new_interpreter_does(tmp_path):
    """The same exit status, output and files as a new process, from its own working directory, environment,
    and $PYTHONPATH (first on sys.path after the working directory); a failure is the same failure."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "shadowed.py").write_text("VALUE = 'from-pythonpath'\n")
    env = {**os.environ, "SNAKETRL_TEST_FLAG": "flag-1", "PYTHONPATH": str(shadow)}
    results = {}
    for how in ("subprocess", "zygote"):
        wd = tmp_path / how
        wd.mkdir()
        (wd / "Snakefile").write_text("import shadowed\n" + SNAKEFILE)
        args = ["--cores", "1", "--quiet", "rules"]
        if how == "subprocess":
            proc = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=wd, env=env, capture_output=True,
                                  text=True, timeout=120)
        else:
            proc = snakemake_cli.run(args, wd, env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (wd / "out.txt").read_text() == "flag-1 from-pythonpath\n"
        (wd / "Snakefile").write_text("rule all:\n    input: 'missing.txt'\n")
        failed = (subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=wd, env=env, capture_output=True,
                                 text=True, timeout=120) if how == "subprocess" else
                  snakemake_cli.run(["-n"], wd, env, timeout=120))
        results[how] = (proc.stdout, failed.returncode, failed.stdout + failed.stderr)

    def same(text, wd):  # without the clock, the run's id and the directory each ran in
        text = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4}", "TIME", text)
        return re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "ID", text.replace(str(tmp_path / wd), "WD"))

    assert same(results["zygote"][0], "zygote") == same(results["subprocess"][0], "subprocess")
    assert results["zygote"][1] == results["subprocess"][1] == 1
    assert same(results["zygote"][2], "zygote") == same(results["subprocess"][2], "subprocess")
    assert "missing.txt" in results["zygote"][2]


def test_a_command_past_its_timeout_is_killed_with_its_jobs(tmp_path):
    (tmp_path / "Snakefile").write_text("rule all:\n    output: 'never.txt'\n    shell: 'sleep 60.4242; touch {output}'\n")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        snakemake_cli.run(["--cores", "1"], tmp_path, timeout=5)
    assert time.monotonic() - started < 30
    time.sleep(1)
    assert not [p for p in psutil.process_iter(["cmdline"]) if "60.4242" in " ".join(p.info["cmdline"] or [])], \
        "the job (its shell or its sleep) outlived its Snakemake"
    proc = snakemake_cli.run(["--cores", "1", "-n"], tmp_path, timeout=60)  # the zygote still serves
    assert proc.returncode == 0 and "never.txt" in proc.stdout, proc.stderr[-2000:]
