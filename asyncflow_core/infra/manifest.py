"""Signed manifests of checkpoint folders: every file's size and sha256 plus the writer's
metadata, with an HMAC-SHA256 over it all keyed by this user's **checkpoint key**, kept outside
any run folder (SECURITY.md: "The checkpoint key"). The DeepSpeed trainer signs its folders
(its loader unpickles, so only signed ones load) and every job checkpoint carries one
(``asyncflow_core.infra.checkpoint.Checkpoints``: what resume verifies). Re-exported from
``asyncflow_core.engines.lmtrain``, where it was first."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncflow_core.contracts.errors import CheckpointError, CheckpointRefusedError, ConfigError

CHECKPOINT_KEY_ENV = "ASYNCFLOW_CHECKPOINT_KEY"
"""The environment variable that holds the checkpoint key (any text of 32 characters or more),
for hosts that must share one key (several nodes, containers); else ``checkpoint_key_file()``."""
_KEY_MIN_CHARS = 32
_MAC_DOMAIN = b"asyncflow-checkpoint-manifest/1\0"
_FILES = "files"
_MAC = "hmac_sha256"


def checkpoint_key_file() -> Path:
    """Where this user's checkpoint key lives when ``ASYNCFLOW_CHECKPOINT_KEY`` is not set:
    ``$XDG_CONFIG_HOME/asyncflow/checkpoint.key`` (an absolute ``XDG_CONFIG_HOME`` only, as the
    XDG spec says), else ``~/.config/asyncflow/checkpoint.key``. Never inside a run folder."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "asyncflow" / "checkpoint.key"


def checkpoint_key(*, who: str, create: bool) -> bytes | None:
    """The key that signs checkpoint manifests: ``ASYNCFLOW_CHECKPOINT_KEY`` if set, else the
    key file (``checkpoint_key_file()``), made with 32 random bytes (hex) and mode 0600 on
    first use when ``create`` (else None when there is none). ``ConfigError`` for a key that
    is too short, or a key file that someone else may read or write. The key itself is never
    put in a message."""
    env = os.environ.get(CHECKPOINT_KEY_ENV)
    if env is not None:
        if len(env.strip()) < _KEY_MIN_CHARS:
            raise ConfigError(
                f"{who}: {CHECKPOINT_KEY_ENV} is set but shorter than {_KEY_MIN_CHARS} "
                "characters; set it to a long random value (python -c 'import secrets; "
                "print(secrets.token_hex(32))') or unset it to use the key file "
                f"{checkpoint_key_file()}"
            )
        return env.strip().encode()
    path = checkpoint_key_file()
    if create and not path.exists():
        _create_key_file(path, who)
    try:
        info = path.stat()
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{who}: cannot read the checkpoint key file {str(path)!r} ({type(exc).__name__}); "
            f"fix it or set {CHECKPOINT_KEY_ENV}"
        ) from None
    if os.name == "posix" and (info.st_mode & 0o077 or info.st_uid != os.getuid()):
        raise ConfigError(
            f"{who}: the checkpoint key file {str(path)!r} is not private to you (mode "
            f"{stat.filemode(info.st_mode)}, owner uid {info.st_uid}); anyone who can read it "
            f"can forge checkpoints: chown it and chmod 600 it, or delete it (a new key is made "
            "on the next save; checkpoints signed with the old one are then refused)"
        )
    if len(text) < _KEY_MIN_CHARS:
        raise ConfigError(
            f"{who}: the checkpoint key file {str(path)!r} holds fewer than {_KEY_MIN_CHARS} "
            "characters; delete it (a new key is made on the next save)"
        )
    return text.encode()


def _create_key_file(path: Path, who: str) -> None:
    """A new random key at ``path``, mode 0600, written whole before it appears under its name
    (several ranks may race: the first link wins, the others read it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as out:
                out.write(secrets.token_hex(32) + "\n")
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{who}: cannot create the checkpoint key file {str(path)!r} ({exc.strerror or exc}); "
            f"set {CHECKPOINT_KEY_ENV} (the same value wherever the checkpoint is loaded)"
        ) from None


def _mac(key: bytes, body: Mapping[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, _MAC_DOMAIN + text.encode(), hashlib.sha256).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _folder_files(folder: Path, manifest: str) -> dict[str, Path]:
    """Every entry under ``folder`` but the manifest, by its ``/``-separated relative path
    (folders themselves left out; links and other non-files kept, for the check to refuse)."""
    out: dict[str, Path] = {}
    for entry in sorted(folder.rglob("*")):
        rel = entry.relative_to(folder).as_posix()
        if rel != manifest and (entry.is_symlink() or not entry.is_dir()):
            out[rel] = entry
    return out


def sign_manifest(
    folder: Path, meta: Mapping[str, Any], key: bytes, *, manifest: str
) -> dict[str, Any]:
    """``meta`` plus ``files`` (every file under ``folder`` but ``manifest``: its sha256 and
    size) and ``hmac_sha256``, an HMAC-SHA256 with ``key`` over the rest: what
    ``read_signed_manifest`` accepts. The caller writes it to ``folder / manifest``."""
    files: dict[str, dict[str, Any]] = {}
    for rel, entry in _folder_files(folder, manifest).items():
        files[rel] = {"sha256": _sha256(entry), "size": entry.stat().st_size}
    body = {**meta, _FILES: files}
    return {**body, _MAC: _mac(key, body)}


_UNPICKLES = "Its loader unpickles its files, which can run code, so AsyncFlow loads only"


def read_signed_manifest(
    folder: Path,
    *,
    manifest: str,
    who: str,
    trust: bool,
    opt_in: str,
    why_signed: str = _UNPICKLES,
) -> dict[str, Any]:
    """The meta of the checkpoint in ``folder`` (its manifest without ``files`` and the MAC),
    after checking, unless ``trust``, that the manifest is signed with this user's key, and
    (trusted too, where the manifest lists its files) that the folder holds exactly its
    files, each of its size and sha256. Nothing else in the folder is opened.
    ``CheckpointRefusedError`` (naming ``opt_in``, the way to load a checkpoint one trusts;
    ``why_signed``: the start of the sentence saying why only signed ones load) when the
    check fails; ``CheckpointError`` when there is no such folder, the manifest is not
    JSON, or a trusted checkpoint's files differ from its manifest."""
    where = f"{who}: checkpoint {str(folder)!r}"
    if not folder.is_dir():
        raise CheckpointError(f"{where} is not readable (no such folder)")

    def refuse(why: str) -> CheckpointError:
        if trust:  # only the files are checked: they are not what was written
            return CheckpointError(f"{where} is damaged: {why}")
        return CheckpointRefusedError(
            f"{where} is refused: {why}. {why_signed} checkpoints it wrote and signed with "
            f"your checkpoint key (${CHECKPOINT_KEY_ENV} or {checkpoint_key_file()}; "
            f"SECURITY.md). If you trust this checkpoint, load it with {opt_in}"
        )

    try:
        raw = (folder / manifest).read_bytes()
    except FileNotFoundError:
        if trust:
            raise CheckpointError(f"{where} is not readable (no {manifest})") from None
        raise refuse(f"it has no manifest ({manifest})") from None
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read {manifest} ({exc.strerror or exc})") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        if trust:
            raise CheckpointError(f"{where}: {manifest} is not JSON ({exc})") from None
        raise refuse(f"its manifest {manifest} is not JSON") from None
    if not isinstance(data, dict):
        if trust:
            raise CheckpointError(f"{where}: {manifest} holds a {type(data).__name__}")
        raise refuse(f"its manifest {manifest} is not a JSON object")
    meta = {k: v for k, v in data.items() if k not in (_FILES, _MAC)}
    if not trust:
        key = checkpoint_key(who=who, create=False)
        if key is None:
            raise refuse(
                f"there is no checkpoint key here (${CHECKPOINT_KEY_ENV} is unset and "
                f"{checkpoint_key_file()} does not exist), so no checkpoint was signed here"
            )
        mac = data.get(_MAC)
        body = {k: v for k, v in data.items() if k != _MAC}
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, body)):
            raise refuse(
                "its manifest is not signed with your checkpoint key (another user or "
                "machine wrote it, or it was edited)"
            )
    files = data.get(_FILES)
    if not isinstance(files, dict):
        if trust:  # trusted but unlisted: nothing to check the files against
            return meta
        raise refuse("its manifest lists no files")
    present = _folder_files(folder, manifest)
    extra = sorted(set(present) - set(files))
    missing = sorted(set(files) - set(present))
    if extra or missing:
        raise refuse(
            f"its files differ from the manifest (not listed: {extra[:3]}, missing: {missing[:3]})"
        )
    for rel, entry in present.items():
        want = files[rel]
        if entry.is_symlink() or not entry.is_file():
            raise refuse(f"{rel} is not a regular file")
        if not isinstance(want, dict) or want.get("size") != entry.stat().st_size:
            raise refuse(f"{rel} is not the size the manifest says (truncated or replaced)")
    for rel, entry in present.items():
        if _sha256(entry) != files[rel].get("sha256"):
            raise refuse(f"{rel} differs from the manifest (its sha256)")
    return meta


__all__ = [
    "CHECKPOINT_KEY_ENV",
    "checkpoint_key",
    "checkpoint_key_file",
    "read_signed_manifest",
    "sign_manifest",
]
