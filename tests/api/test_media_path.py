"""file:// media URLs under --media-path (api/media_path.py): resolution, validation, containment."""

from __future__ import annotations

import os

import pytest

from mlxcel.api.media_path import NO_ROOT, UNAVAILABLE, MediaPathRefused, read, resolve


@pytest.fixture()
def root(tmp_path):
    media = (tmp_path / "media").resolve()
    (media / "sub").mkdir(parents=True)
    (media / "cat.png").write_bytes(b"cat")
    (media / "sub" / "dog.png").write_bytes(b"dog")
    (tmp_path / "secret.txt").write_bytes(b"secret")
    return media


def refused(root, ref, words):
    with pytest.raises(MediaPathRefused) as e:
        resolve(root, ref)
    assert words in str(e.value)


def test_relative_absolute_inside_and_bare_forms_read_the_same_file(root):
    for ref in ("cat.png", "/cat.png", str(root / "cat.png")):
        assert resolve(root, ref) == root / "cat.png"
    assert resolve(root, "sub/dog.png") == root / "sub" / "dog.png"
    assert read(root, "file://cat.png", 100) == b"cat"
    assert read(root, f"file://{root}/cat.png", 100) == b"cat"


def test_an_absolute_path_outside_the_root_is_an_escape(root):
    refused(root, str(root.parent / "secret.txt"), UNAVAILABLE)
    refused(root, "/etc/passwd", UNAVAILABLE)


def test_outside_and_missing_are_answered_alike(root):
    """An existing file outside the root, a missing one outside it, a missing one inside it and
    a symlink out all give the same message, so existence outside the root cannot be probed."""
    os.symlink(root.parent / "secret.txt", root / "out.png")
    answers = set()
    for ref in (str(root.parent / "secret.txt"), str(root.parent / "nothing.txt"), "/etc/passwd",
                "/etc/no-such-file", "missing.png", "out.png", "/root/.ssh/id_rsa"):
        with pytest.raises(MediaPathRefused) as e:
            read(root, "file://" + ref, 100)
        answers.add(str(e.value))
    assert answers == {UNAVAILABLE}


def test_dot_dot_anywhere_is_refused(root):
    for ref in ("../secret.txt", "sub/../cat.png", "a..b.png"):
        refused(root, ref, "'..' is not allowed")


def test_symlinks_out_are_escapes_and_links_within_resolve(root):
    os.symlink(root.parent / "secret.txt", root / "out.png")
    os.symlink(root / "sub" / "dog.png", root / "in.png")
    os.symlink(root.parent, root / "updir")
    refused(root, "out.png", UNAVAILABLE)
    refused(root, "updir/secret.txt", UNAVAILABLE)
    assert resolve(root, "in.png") == root / "sub" / "dog.png"


def test_name_validation(root):
    refused(root, "x" * 256, "255 bytes")
    for ref in (" cat.png", "cat.png ", "cat.", "ca*t.png", "c?t.png", 'c"t', "c<t", "c|t", "c\x01t",
                "a\uff0e\uff0e/b", "a\u2215b", "a\ufeffb"):
        with pytest.raises(MediaPathRefused):
            resolve(root, ref)
    for ref in ("%2e%2e/secret.txt", "sub%2fdog.png", "a%5cb", "a%00b", "%2E"):
        refused(root, ref, "percent-encoded")
    refused(root, "missing.png", "resolve against the --media-path directory")


def test_only_regular_files_are_read(root):
    refused_read(root, "file://sub", "regular file")
    os.mkfifo(root / "pipe")
    refused_read(root, "file://pipe", "regular file")


def test_size_limit_and_no_root(root):
    refused_read(root, "file://cat.png", "payload limit", max_bytes=2)
    with pytest.raises(MediaPathRefused, match=NO_ROOT):
        read(None, "file://cat.png", 100)


def refused_read(root, url, words, max_bytes=100):
    with pytest.raises(MediaPathRefused) as e:
        read(root, url, max_bytes)
    assert words in str(e.value)
