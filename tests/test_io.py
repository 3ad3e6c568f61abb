"""Outputs replaced, not lost (snaketrl.io): a writer killed at each step of a replacement leaves the old output
or the new one, and the next write of that output removes whatever the killed one left."""

import math
import multiprocessing
import os
import shutil

import pytest

from snaketrl.io import atomic, leftovers, recover, write_json, write_jsonl

DIED = 3  # the exit status of a child that "crashed" (os._exit: no cleanup runs, as under SIGKILL)


def _write_dir(path, content: str) -> None:
    with atomic(path, directory=True) as tmp:
        (tmp / "weights").write_text(content)
        (tmp / "config.json").write_text("{}")


def _write_file(path, content: str) -> None:
    with atomic(path) as tmp:
        tmp.write_text(content)


def _crash_after_replace(n: int) -> None:
    """Die right after the process's n-th rename."""
    real, calls = os.replace, []

    def replace(src, dst):
        real(src, dst)
        calls.append(dst)
        if len(calls) == n:
            os._exit(DIED)

    os.replace = replace


def _crash_while_deleting() -> None:
    """Die half-way through deleting a directory: one file gone, the rest there."""
    def rmtree(path, *args, **kwargs):
        os.unlink(min(entry.path for entry in os.scandir(path) if entry.is_file()))
        os._exit(DIED)

    shutil.rmtree = rmtree


def _child(write, path, step: str) -> None:
    if step == "writing":
        with atomic(path, directory=write is _write_dir) as tmp:
            if write is _write_dir:
                (tmp / "weights").write_text("new, half")
            else:
                tmp.write_text("new, half")
            os._exit(DIED)
    if step == "aside":
        _crash_after_replace(1)  # the old output renamed aside, the new one not yet in
    elif step == "in":
        _crash_after_replace(2)  # the new one in, the old one not yet deleted
    elif step == "file":
        _crash_after_replace(1)
    elif step == "deleting":
        _crash_while_deleting()
    write(path, "new")
    os._exit(0)


def crashed(write, path, step: str) -> None:
    process = multiprocessing.get_context("fork").Process(target=_child, args=(write, path, step))
    process.start()
    process.join(60)
    assert process.exitcode == DIED, f"{step}: the writer ended with {process.exitcode}, not at that step"


def content(path) -> str | None:
    """The output's weights as a reader finds them at `path`; None if there is none."""
    weights = path / "weights" if path.is_dir() else path
    return weights.read_text() if weights.is_file() else None


def on_disk(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


@pytest.mark.parametrize("step, there, left", [
    ("writing", "old", [".merged.tmp{pid}"]),
    ("aside", None, [".merged.replaced", ".merged.tmp{pid}"]),
    ("in", "new", [".merged.replaced", "merged"]),
    ("deleting", "new", [".merged.replaced", "merged"]),
])
def test_a_directory_output_killed_at_each_step_of_its_replacement_is_old_or_new(tmp_path, step, there, left):
    path = tmp_path / "merged"
    _write_dir(path, "old")
    crashed(_write_dir, path, step)
    found = on_disk(tmp_path)
    pid = next((n.rsplit("tmp", 1)[1] for n in found if ".tmp" in n), "")
    assert found == sorted({*[n.format(pid=pid) for n in left], *(["merged"] if there else [])})
    assert content(path) == there
    if there is None:
        # Killed between the two renames: the old output is whole beside it, and the next write (or a reader
        # through `recover`) puts it back before anything else happens.
        assert content(tmp_path / ".merged.replaced") == "old"
        recover(path)
        assert content(path) == "old" and on_disk(tmp_path) == ["merged"]
    # The next write of the same output removes what the killed one left, under whatever pid it had.
    _write_dir(path, "newer")
    assert content(path) == "newer" and on_disk(tmp_path) == ["merged"]
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "weights"]


@pytest.mark.parametrize("step, there", [("writing", "old"), ("file", "new")])
def test_a_file_output_killed_while_written_or_renamed_is_old_or_new(tmp_path, step, there):
    path = tmp_path / "metrics.json"
    _write_file(path, "old")
    crashed(_write_file, path, step)
    assert content(path) == there
    assert len(on_disk(tmp_path)) == (2 if step == "writing" else 1)  # a half-written temporary copy
    _write_file(path, "newer")
    assert on_disk(tmp_path) == ["metrics.json"] and content(path) == "newer"


def test_an_output_first_written_and_killed_leaves_no_output_and_its_leftover_goes(tmp_path):
    path = tmp_path / "model"
    crashed(_write_dir, path, "writing")
    assert not path.exists() and len(leftovers(path)) == 1
    _write_dir(path, "new")
    assert on_disk(tmp_path) == ["model"]


def test_leftovers_are_only_that_outputs_own(tmp_path):
    """`model` and `model.json` beside it: the temporary copies of one are not the other's."""
    names = [".model.tmp12", ".model.tmp-ranks", ".model.tmp34.json", ".model.json.tmp5", ".modelx.tmp6", "model"]
    for name in names:
        (tmp_path / name).mkdir()
    assert [p.name for p in leftovers(tmp_path / "model")] == [".model.tmp-ranks", ".model.tmp12"]
    assert [p.name for p in leftovers(tmp_path / "model.json")] == [".model.tmp34.json"]
    with pytest.raises(ValueError, match=r"tag '1\.2' has a dot or a slash"):
        with atomic(tmp_path / "model", tag="1.2"):
            pass


def test_a_failed_write_keeps_the_old_output(tmp_path):
    path = tmp_path / "adapter"
    _write_dir(path, "old")
    with pytest.raises(RuntimeError, match="^the save failed$"):
        with atomic(path, directory=True) as tmp:
            (tmp / "weights").write_text("new, half")
            raise RuntimeError("the save failed")
    assert content(path) == "old" and on_disk(tmp_path) == ["adapter"]


def test_a_directory_replaces_a_file_and_a_file_a_directory(tmp_path):
    path = tmp_path / "out"
    _write_file(path, "a file")
    _write_dir(path, "a directory")
    assert content(path) == "a directory"
    _write_file(path, "a file again")
    assert content(path) == "a file again" and on_disk(tmp_path) == ["out"]


def test_a_value_json_cannot_hold_is_an_error_naming_its_key_path(tmp_path):
    import numpy as np

    path = tmp_path / "metrics.json"
    write_json({"loss": 1.5}, path)
    with pytest.raises(TypeError, match=rf"^{tmp_path}/metrics.json: \['scores'\]\['rm'\]\[1\] is a float32 "
                                        rf"\(np.float32\(0.5\)\), which JSON cannot hold$"):
        write_json({"loss": 2.0, "scores": {"rm": [0.25, np.float32(0.5)]}}, path)
    assert path.read_text() == '{\n  "loss": 1.5\n}'  # untouched, and no string "0.5" written in its place
    with pytest.raises(TypeError, match=rf"^{tmp_path}/rows.jsonl row 2: \['path'\] is a PosixPath"):
        write_jsonl([{"path": "a"}, {"path": tmp_path}], tmp_path / "rows.jsonl")
    assert on_disk(tmp_path) == ["metrics.json"]
    write_json({"nan": math.nan}, path)  # JSON as this workflow writes it: NaN for a diverged value
    assert path.read_text() == '{\n  "nan": NaN\n}'
