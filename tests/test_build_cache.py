"""The C++ build cache holds code this process runs: a folder others can write is not used."""

import os
import stat

import pytest

from moetron.kernels import cpp_build


def test_a_build_cache_others_can_write_is_replaced_by_a_private_one(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(shared))
    os.chmod(shared, 0o755)
    assert cpp_build.build_directory().parent == shared  # ours, not writable by others: used
    os.chmod(shared, 0o777)  # anyone could plant a library here
    with pytest.warns(UserWarning, match=rf"{shared} is writable by other users .*building .* instead"):
        private = cpp_build.build_directory()
    assert shared not in private.parents and private.parent.stat().st_uid == os.getuid()
    assert stat.S_IMODE(private.parent.stat().st_mode) == 0o700
    mine = shared / private.name
    mine.mkdir()
    os.chmod(shared, 0o755)
    os.chmod(mine, 0o757)
    assert "the C++ build cache" in cpp_build.cache_problem(mine)
    os.chmod(mine, 0o755)
    assert cpp_build.cache_problem(mine) is None and cpp_build.build_directory() == mine
    if os.getuid() == 0:  # root can give the folder to another user: then it is not ours
        os.chown(mine, 12345, -1)
        assert "belongs to user 12345" in cpp_build.cache_problem(mine)
