"""The first-use build cache is trusted only when it is the user's own (multi_tensor/build.py).

A module planted in the cache (or a cache directory) that another user owns, or that its group
or others may write, is neither loaded nor built over: the kernels are built into a private
directory of the process instead (mode 0700), with one warning. The compiler is replaced by a
command that writes a marker file, so no test here compiles anything; ownership by another
user is simulated by the uid the check compares with.
"""
from __future__ import annotations

import os
import stat
import sys
import tempfile
import warnings

import pytest

from multi_tensor import build

ISA = "default"
PLANTED = b"a library another user placed in the cache"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache with a planted module at the build's own path (everything 0755 and ours, as a
    cache made under umask 022 is), the compiler replaced, private directories under tmp_path."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FUSED_OPTIM_CACHE", str(root))
    monkeypatch.setattr(build, "_private", [])
    private = tmp_path / "private"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))

    def fake_compile(isa, output, src=None):
        return [sys.executable, "-c", f"open({output!r}, 'wb').write(b'built')"]

    monkeypatch.setattr(build, "compile_command", fake_compile)
    path = build.cache_path(ISA)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(PLANTED)
    for p in (str(root), os.path.dirname(path), path):
        os.chmod(p, 0o755)
    return path


def _key_dir(path):
    return os.path.dirname(path)


def _root(path):
    return os.path.dirname(os.path.dirname(path))


def _make_writable(where, bits):
    def change(path, monkeypatch):
        target = where(path)
        os.chmod(target, stat.S_IMODE(os.stat(target).st_mode) | bits)
    return change


def _foreign_owner(path, monkeypatch):
    uid = os.getuid()
    monkeypatch.setattr(build, "_current_uid", lambda: uid + 1)


UNTRUSTED = {
    "module writable by its group": (_make_writable(lambda p: p, stat.S_IWGRP), "writable"),
    "module writable by others": (_make_writable(lambda p: p, stat.S_IWOTH), "writable"),
    "key directory writable by its group": (_make_writable(_key_dir, stat.S_IWGRP), "writable"),
    "cache directory writable by others": (_make_writable(_root, stat.S_IWOTH), "writable"),
    "owned by another user": (_foreign_owner, "owned by uid"),
}


@pytest.mark.parametrize("case", list(UNTRUSTED))
def test_an_untrusted_cache_is_not_loaded(cache, monkeypatch, case):
    change, said = UNTRUSTED[case]
    change(cache, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = build.build(ISA, quiet=True)
        again = build.build(ISA, quiet=True)
    assert built == again != cache
    with open(built, "rb") as f:
        assert f.read() == b"built"  # rebuilt, not the planted library
    with open(cache, "rb") as f:
        assert f.read() == PLANTED  # and nothing written into the untrusted cache
    private = _root(built)
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    assert os.stat(private).st_uid == os.getuid()
    assert build.untrusted(built) is None or case == "owned by another user"
    ours = [w for w in caught if "build cache is not used" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]  # one warning per process
    assert said in str(ours[0].message) and "FUSED_OPTIM_CACHE" in str(ours[0].message)
    with pytest.raises(build.BuildError, match="not loading"):
        build.load(ISA, cache)


def test_the_users_own_cache_is_used(cache):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.build(ISA, quiet=True) == cache
    assert not [w for w in caught if "build cache" in str(w.message)]


def test_a_new_cache_is_private_whatever_the_umask(tmp_path, monkeypatch):
    """Directories made 0700 and the module 0755 under umask 002 (which would let the group
    write them), so the next process trusts what this one built."""
    root = tmp_path / "fresh"
    monkeypatch.setenv("FUSED_OPTIM_CACHE", str(root))
    monkeypatch.setattr(build, "_private", [])
    # (as a linker does: the output made anew, with the umask's mode)
    remake = "import os, sys; os.remove(sys.argv[1]); open(sys.argv[1], 'wb').write(b'x')"
    monkeypatch.setattr(build, "compile_command",
                        lambda isa, output, src=None: [sys.executable, "-c", remake, output])
    old = os.umask(0o002)
    try:
        path = build.build(ISA, quiet=True)
    finally:
        os.umask(old)
    assert _root(path) == str(root)
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (_root(path), _key_dir(path), path)] == [
        0o700, 0o700, 0o755]
    assert build.untrusted(path) is None

