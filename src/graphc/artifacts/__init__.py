"""Artifacts: what `graphc compile` writes and `graphc run` trusts only after checking.

    manifest.py   the manifest's dataclasses: the one typed contract between compiler and runtime
    schema.py     every manifest value checked before the runtime uses it
    directory.py  the directory on disk: atomic write, replace rules, read and verify
    signing.py    Ed25519 signatures over the manifest (which hashes every file)
    writer.py     the compiler's side: weights files, model fingerprint, manifest assembly
"""
