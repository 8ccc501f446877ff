"""One file per trained model: a magic line, a JSON header, then the model payload.

Layout::

    b"KVPREDICTOR\\n" | header length (8 bytes, little endian) | header (UTF-8 JSON) | payload

The header is read and checked *before* the payload is decoded (the payload of a
scikit-learn model is a pickle, so it must never be unpickled unless the header and its
SHA-256 match). Checks, each failing with a :class:`PredictorError` that names the problem:
magic, artifact format version, model name, feature schema version and feature names,
payload checksum. Files are written atomically (temporary file + rename).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base.atomic import write_atomic
from kvprefetch.controlplane.base.errors import PredictorError
from kvprefetch.predictors.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION

MAGIC = b"KVPREDICTOR\n"
#: Bump when the container layout or header fields change incompatibly.
ARTIFACT_FORMAT_VERSION = 1
_LEN_BYTES = 8
_MAX_HEADER_BYTES = 16 << 20


def write_artifact(
    path: str | Path,
    *,
    model: str,
    payload: bytes,
    payload_encoding: str,
    params: dict[str, Any],
    train: dict[str, Any],
) -> Path:
    """Write one artifact atomically; returns its path."""
    path = Path(path)
    header = {
        "format_version": ARTIFACT_FORMAT_VERSION,
        "model": model,
        "feature_schema_version": FEATURE_SCHEMA_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "payload_encoding": payload_encoding,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_bytes": len(payload),
        "params": params,
        "train": train,
    }
    blob = json.dumps(header, sort_keys=True).encode()
    write_atomic(path, [MAGIC, len(blob).to_bytes(_LEN_BYTES, "little"), blob, payload])
    return path


def read_header(path: str | Path) -> dict[str, Any]:
    """The checked header of an artifact (payload not verified)."""
    return _read(path, None, verify_payload=False)[0]


def read_artifact(path: str | Path, expected_model: str | None) -> tuple[dict[str, Any], bytes]:
    """Header and payload of an artifact, after every check (see the module docstring)."""
    return _read(path, expected_model, verify_payload=True)


def _read(
    path: str | Path, expected_model: str | None, *, verify_payload: bool
) -> tuple[dict[str, Any], bytes]:
    path = Path(path)
    where = f"predictor artifact {str(path)!r}"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PredictorError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    if not data.startswith(MAGIC):
        raise PredictorError(f"{where}: not a kvprefetch predictor artifact (bad magic)")
    start = len(MAGIC) + _LEN_BYTES
    if len(data) < start:
        raise PredictorError(f"{where}: corrupt: truncated header")
    n = int.from_bytes(data[len(MAGIC) : start], "little")
    if n > _MAX_HEADER_BYTES or len(data) < start + n:
        raise PredictorError(f"{where}: corrupt: truncated header")
    try:
        header = json.loads(data[start : start + n])
    except ValueError as exc:
        raise PredictorError(f"{where}: corrupt: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise PredictorError(f"{where}: corrupt: header is not a JSON object")
    version = header.get("format_version")
    if version != ARTIFACT_FORMAT_VERSION:
        raise PredictorError(
            f"{where}: artifact format version {version!r} is not supported "
            f"(this kvprefetch reads version {ARTIFACT_FORMAT_VERSION}); retrain the model"
        )
    model = header.get("model")
    if expected_model is not None and model != expected_model:
        raise PredictorError(f"{where}: holds a {model!r} model, not {expected_model!r}")
    schema = header.get("feature_schema_version")
    if schema != FEATURE_SCHEMA_VERSION:
        raise PredictorError(
            f"{where}: feature schema version {schema!r} does not match this kvprefetch's "
            f"version {FEATURE_SCHEMA_VERSION}; retrain the model"
        )
    names = header.get("feature_names")
    if names != list(FEATURE_NAMES):
        have = set(names) if isinstance(names, list) else set()
        missing = [f for f in FEATURE_NAMES if f not in have]
        extra = sorted(have - set(FEATURE_NAMES))
        raise PredictorError(
            f"{where}: feature mismatch: model was trained on other features "
            f"(missing {missing}, unexpected {extra}, or a different order); retrain the model"
        )
    payload = data[start + n :]
    if verify_payload and (len(payload) != header.get("payload_bytes") or (
        hashlib.sha256(payload).hexdigest() != header.get("payload_sha256")
    )):
        raise PredictorError(f"{where}: corrupt: payload checksum mismatch")
    return header, payload
