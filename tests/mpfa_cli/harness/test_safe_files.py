"""Files mpfa writes are owner-only and never written through a symbolic link (a planted link cannot make mpfa
overwrite its target); a replaced file is whole or unchanged."""
from __future__ import annotations

import stat

import pytest

from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.safe_files import append_private, private_dir, replace_private, touch_private, write_private
from mpfa.mpfa_cli.harness.server import ServerProcess


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_files_and_folders_are_owner_only(tmp_path):
    folder = private_dir(tmp_path / "a" / "b", "test folder")
    write_private(folder / "written", b"x", "test file")
    touch_private(folder / "touched", "test file")
    with append_private(folder / "appended", "test file") as stream:
        stream.write(b"x")
    assert _mode(folder) == 0o700
    assert [_mode(folder / name) for name in ("written", "touched", "appended")] == [0o600] * 3


@pytest.mark.parametrize("write", [
    lambda path: write_private(path, b"evil", "export file"),
    lambda path: touch_private(path, "export file"),
    lambda path: append_private(path, "export file"),
], ids=["replace", "touch", "append"])
@pytest.mark.parametrize("dangling", [False, True], ids=["link", "dangling link"])
def test_a_symbolic_link_is_refused_in_one_line_and_its_target_left_alone(tmp_path, write, dangling):
    target = tmp_path / "precious"
    if not dangling:
        target.write_text("keep me")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    with pytest.raises(UserError, match=f"export file {link} is a symbolic link; mpfa does not write through one"):
        write(link)
    assert (target.read_text() == "keep me") if not dangling else not target.exists()


def test_a_replaced_file_is_whole_or_unchanged(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text("old")
    path.chmod(0o644)
    with pytest.raises(RuntimeError), replace_private(path, "baseline") as stream:
        stream.write("half")
        raise RuntimeError("the writer broke")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["baseline.json"]
    with replace_private(path, "baseline") as stream:
        stream.write("new")
    assert path.read_text() == "new" and _mode(path) == 0o600


def test_a_file_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match=f"cannot write export file {blocker / 'x.json'}: Not a directory"):
        write_private(blocker / "x.json", b"{}", "export file")


def test_server_logs_are_owner_only_and_never_written_through_a_link(tmp_path):
    log = tmp_path / "runs" / "server-fa4-bf16-1.log"
    server = ServerProcess(["true"], log, "http://127.0.0.1:9")
    server.start()
    server.process.wait(timeout=10)
    assert _mode(log.parent) == 0o700 and _mode(log) == 0o600
    planted = tmp_path / "runs" / "server-fa4-bf16-2.log"
    planted.symlink_to(tmp_path / "victim")
    with pytest.raises(UserError, match="server log .* is a symbolic link"):
        ServerProcess(["true"], planted, "http://127.0.0.1:9").start()
    assert not (tmp_path / "victim").exists()
