"""traindx.common.atomic, the one atomic writer: a write that fails part-way leaves the old file
whole and no temporary file beside it."""

import json
import os

import pytest

from traindx.common.atomic import replace_with, write_bytes, write_json, write_text


def _names(folder):
    return sorted(os.listdir(folder))


def test_write_text_bytes_json_replace_the_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old", encoding="utf-8")
    write_text(target, "new ✓")
    assert target.read_text(encoding="utf-8") == "new ✓"
    write_bytes(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    write_json(str(target), {"a": [1, 2]}, indent=1)
    assert json.loads(target.read_text(encoding="utf-8")) == {"a": [1, 2]}
    assert _names(tmp_path) == ["out.txt"]


def test_write_json_whose_serialiser_raises_leaves_the_old_file(tmp_path):
    target = tmp_path / "findings.json"
    target.write_text('{"old": true}', encoding="utf-8")

    class Unserialisable:
        pass

    with pytest.raises(TypeError):
        write_json(target, {"x": Unserialisable()})

    def refuse(value):
        raise ValueError("cannot serialise")

    with pytest.raises(ValueError):
        write_json(target, {"x": Unserialisable()}, default=refuse)
    assert target.read_text(encoding="utf-8") == '{"old": true}'
    assert _names(tmp_path) == ["findings.json"]


def test_write_text_to_a_missing_folder_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        write_text(tmp_path / "no-such-folder" / "f.txt", "x")
    assert _names(tmp_path) == []


def test_replace_with_a_writer_that_fails_midway_leaves_the_old_file(tmp_path):
    target = tmp_path / "report.html"
    target.write_text("old report", encoding="utf-8")

    def half_then_fail(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("half a rep")
        raise RuntimeError("serialiser failed")

    with pytest.raises(RuntimeError):
        replace_with(target, half_then_fail)
    assert target.read_text(encoding="utf-8") == "old report"
    assert _names(tmp_path) == ["report.html"]

    with pytest.raises(KeyboardInterrupt):  # an interrupt too: BaseException, not only Exception

        def interrupted(tmp):
            open(tmp, "w").close()
            raise KeyboardInterrupt

        replace_with(target, interrupted)
    assert _names(tmp_path) == ["report.html"]


def test_replace_with_writes_a_file_the_writer_produced(tmp_path):
    target = tmp_path / "ledger.csv"
    replace_with(str(target), lambda tmp: open(tmp, "w").write("a,b\n"))
    assert target.read_text() == "a,b\n"
    assert _names(tmp_path) == ["ledger.csv"]
