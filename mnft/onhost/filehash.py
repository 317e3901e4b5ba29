"""A file's sha256, read in chunks: the one reader of the host modules that hash a file (the tree hash, the record of
what mnft placed, uninstall, imagehost's .sif identity, envhost's wheels). The controller hashes its own files with
it too (mnft.env), so both sides agree. Python >= 3.8 and the standard library only.
"""

from __future__ import annotations

CHUNK = 1 << 20


def sha256_file(path) -> str:
    """A file's sha256, read in chunks."""
    import hashlib  # in the functions that hash: a mark or seen round-trip imports nothing it does not use

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(CHUNK)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()
