"""The artifact file: one ``.safetensors`` file, written atomically and read without unpickling.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor dtypes, shapes
and offsets, plus string metadata) and raw tensor bytes; reading it runs no code. qplug keeps its
document as one metadata string and, beside it, the digest of the file's tensors and document
(:mod:`qplug_core.serialization.digest`), checked whenever a file is read. safetensors writes its
metadata in a random order, so qplug writes the two strings back sorted: identical models give
byte-identical files. Before safetensors parses anything, the first bytes are checked so that a
pickle (``torch.save``) file, a truncated file or an absurd header length gets a clear error.

The file is opened once (non-blocking, so a FIFO cannot hang the open), checked on that
descriptor with ``fstat`` (a regular file, its size) and read only through it: safetensors checks
the header of ``/proc/self/fd/N`` (the same open file, whatever the path names by then) and each
tensor is then read from the descriptor into its own storage, or, where that path does not exist,
safetensors parses the bytes read from the descriptor. A path swapped for a FIFO or another file after
the check is never opened again.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file

from qplug_core.errors import SerializationError, UnsafeFileError
from qplug_core.serialization.digest import DIGEST_KEY, check_digest, digest_of, digest_of_parts

#: safetensors metadata key under which the qplug document is stored
METADATA_KEY = "qplug"
#: the header size safetensors itself accepts at most
MAX_HEADER_BYTES = 100_000_000
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_PICKLE_PROTO = b"\x80"
_PICKLE_VERSIONS = (b"\x02", b"\x03", b"\x04", b"\x05")
#: bytes hashed at a time when a file's digest is checked without reading its tensors
_BLOCK = 1 << 24


def write_artifact_file(path: Path, document: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write atomically: a temporary file beside ``path``, flushed to disk, then renamed over it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        mode = _mode_for(path, temporary)
        stored = _storable(tensors)
        metadata = {METADATA_KEY: document, DIGEST_KEY: digest_of(document, stored)}
        save_file(stored, str(temporary), metadata=metadata)
        with open(temporary, "r+b") as written:
            _sort_metadata(written, metadata)
            os.fsync(written.fileno())
        os.chmod(temporary, mode)  # after the rewrite above: the mode may be read-only
        os.replace(temporary, path)
    except OSError as exc:
        raise SerializationError(f"cannot write {path}: {exc.strerror or exc}; check that the directory "
                                 "exists and is writable", path=str(path)) from exc
    except Exception as exc:  # safetensors refuses some tensors (unsupported dtypes) with plain errors
        raise SerializationError(f"cannot write {path}: {exc}", path=str(path)) from exc
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()


def _mode_for(path: Path, temporary: Path) -> int:
    """The permissions the written file keeps: those of the file it replaces, else what the
    umask gives a new file (``temporary`` is created here to learn it). safetensors writes 0600,
    so a model saved by a CI job could not be read by a server running as another user."""
    with contextlib.suppress(FileNotFoundError):
        return stat.S_IMODE(os.stat(path).st_mode)
    temporary.touch(exist_ok=False)
    return stat.S_IMODE(os.stat(temporary).st_mode)


_METADATA_START = b'{"__metadata__":'


def _sort_metadata(file: BinaryIO, metadata: dict[str, str]) -> None:
    """Rewrite the header's metadata object with its keys sorted, in place (the same pairs, so the
    same length): safetensors writes it from a Rust HashMap, in an order that changes from one save
    to the next."""
    ordered = json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    file.seek(8)
    written = file.read(len(_METADATA_START) + len(ordered))
    if not written.startswith(_METADATA_START) or json.loads(written[len(_METADATA_START):]) != metadata:
        raise ValueError("safetensors wrote the metadata in a layout this qplug-core does not know")
    file.seek(8 + len(_METADATA_START))
    file.write(ordered)


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no memory (safetensors refuses shared storage)."""
    seen: set[int] = set()
    result = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
        elif tensor.numel():
            seen.add(pointer)
        result[key] = tensor
    return result


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def _check_regular(path: Path, mode: int) -> None:
    """Only regular files are read: opening a FIFO blocks, a device can be endless."""
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise SerializationError(f"{path} is {kind}, not a regular file; qp.load reads the .safetensors "
                                 "files written by qp.save", path=str(path))


def _open_regular(path: Path) -> tuple[int, int]:
    """A descriptor of the regular file at ``path`` and its size, checked on the descriptor."""
    _check_regular(path, os.stat(path).st_mode)  # early: a device is never even opened
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        info = os.fstat(fd)
        _check_regular(path, info.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def _read_exactly(fd: int, size: int, offset: int = 0) -> bytes:
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 1 << 24), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _descriptor_path(fd: int) -> str | None:
    """A path that opens the file of ``fd`` itself (Linux's ``/proc/self/fd``), if there is one."""
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else None


#: the safetensors dtype names qplug reads, as torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _read_tensors(fd: int) -> dict[str, torch.Tensor]:
    """Every tensor of the file, read from ``fd`` straight into storage of its own: each byte is
    copied once and nothing is mapped (a mapped file's pages count in the process's resident set
    beside the copies: loading peaked at twice the file). The header was checked by safetensors."""
    length, entries = _header(fd)
    tensors = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}, which qplug does not write")
        tensor = torch.empty(entry["shape"], dtype=dtype)
        begin, end = entry["data_offsets"]
        _read_into(fd, tensor.reshape(-1).view(torch.uint8).numpy(), 8 + length + begin, end - begin)
        tensors[name] = tensor
    return tensors


def _read_into(fd: int, target: Any, offset: int, size: int) -> None:
    if target.nbytes != size:
        raise ValueError(f"a tensor of {target.nbytes} bytes has {size} bytes in the file")
    view, done = memoryview(target), 0
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise ValueError("the file ends inside a tensor")
        done += got


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with storage of its own: safetensors returns views of one buffer, and a graph
    may modify a constant in place (``aten::detach_`` of a folded constant in DeBERTa-v2 raised
    "Can't detach views in-place" on the first call of a loaded model)."""
    return tensor.clone() if tensor._base is not None else tensor


def _contents(fd: int, size: int) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata strings and the tensors, read through ``fd`` only."""
    by_descriptor = _descriptor_path(fd)
    if by_descriptor is not None:
        with safe_open(by_descriptor, framework="pt", device="cpu") as file:  # checks the header
            metadata = file.metadata() or {}
        return metadata, _read_tensors(fd)
    data = _read_exactly(fd, size)
    tensors = {key: _owned(tensor) for key, tensor in safetensors_load(data).items()}
    # safetensors has parsed the header: its metadata is a map of strings
    return json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__", {}), tensors


def read_artifact_file(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """The qplug document and the tensors of the file at ``path``, checked against the file's
    digest; never unpickles."""
    with _checked_descriptor(path) as (fd, size):
        try:
            metadata, tensors = _contents(fd, size)
        except Exception as exc:  # safetensors reports every malformed file as a plain exception
            raise SerializationError(f"{path} is corrupt: {exc}", path=str(path)) from exc
    document = _document(path, metadata)
    check_digest(path, metadata.get(DIGEST_KEY), lambda: digest_of(document, tensors))
    return document, tensors


def read_artifact_document(path: Path, *, verify: bool) -> str:
    """The qplug document of the file at ``path`` from its header alone, as plain JSON text (what
    describing a file needs: a 1.45 GB file was read, copied and hashed to print its header); with
    ``verify``, checked against the file's digest in one streamed pass over its tensors."""
    with _checked_descriptor(path) as (fd, _):
        try:
            length, header = _header(fd)
            metadata = header.get("__metadata__") or {}
            if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
                raise ValueError("its metadata is not a map of strings")
        except (ValueError, AttributeError, RecursionError) as exc:
            raise SerializationError(f"{path} is corrupt: {exc}", path=str(path)) from exc
        document = _document(path, metadata)
        if verify:
            check_digest(path, metadata.get(DIGEST_KEY),
                         lambda: _streamed_digest(path, fd, 8 + length, document, header))
    return document


def _streamed_digest(path: Path, fd: int, start: int, document: str, header: dict) -> str:
    """The digest of the file's tensors (from byte ``start``) and ``document``, read through ``fd``
    a block at a time."""
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    try:
        layout = {name: (_DTYPES[entry["dtype"]], list(entry["shape"])) for name, entry in entries.items()}
        spans = {name: (int(entry["data_offsets"][0]), int(entry["data_offsets"][1]))
                 for name, entry in entries.items()}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SerializationError(f"{path} is corrupt: its header lists a tensor qplug cannot read ({exc!r})",
                                 path=str(path)) from exc

    def chunks(name: str) -> Iterable[bytes]:
        begin, end = spans[name]
        for offset in range(begin, end, _BLOCK):
            yield _read_exactly(fd, min(_BLOCK, end - offset), start + offset)

    return digest_of_parts(document, layout, chunks)


def _document(path: Path, metadata: dict[str, str]) -> str:
    document = metadata.get(METADATA_KEY)
    if document is None:
        raise SerializationError(f"{path} is a safetensors file without qplug metadata; qp.load reads "
                                 "the files written by qp.save", path=str(path))
    return document


@contextlib.contextmanager
def _checked_descriptor(path: Path) -> Iterator[tuple[int, int]]:
    """A descriptor of the regular file at ``path`` and its size, its head and extent checked."""
    try:
        fd, size = _open_regular(path)
    except FileNotFoundError as exc:
        raise SerializationError(f"{path}: no such file", path=str(path)) from exc
    except OSError as exc:
        raise SerializationError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    try:
        _check_head(path, _read_exactly(fd, 9), size)
        _check_data_extent(path, fd, size)
        yield fd, size
    finally:
        os.close(fd)


def _header(fd: int) -> tuple[int, Any]:
    """The header's length and its JSON (not checked: safetensors checks it where tensors are read)."""
    length = int.from_bytes(_read_exactly(fd, 8), "little")
    return length, json.loads(_read_exactly(fd, length, 8))


def _check_data_extent(path: Path, fd: int, size: int) -> None:
    """Say "truncated" (or "extra bytes") when the tensors the header lists end elsewhere than the
    file: an interrupted copy cuts the tensor data, which safetensors reports as a malformed header.
    A header that does not parse is left to safetensors' own message."""
    try:
        header, entries = _header(fd)
        end = 8 + header + max((int(entry["data_offsets"][1]) for name, entry in entries.items()
                                if name != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return
    if end > size:
        raise SerializationError(f"{path} is truncated: its tensors need {end} bytes but the file has {size}; "
                                 "copy the file again", path=str(path))
    if end < size:
        raise SerializationError(f"{path} is corrupt: {size - end} bytes follow the last tensor the header "
                                 "lists; copy the file again", path=str(path))


def _check_head(path: Path, head: bytes, size: int) -> None:
    header = int.from_bytes(head[:8], "little") if len(head) >= 8 else None
    looks_safe = (header is not None and header <= MAX_HEADER_BYTES and 8 + header <= size
                  and head[8:9] == b"{")
    pickled = head[:4] in _ZIP_MAGICS or (head[:1] == _PICKLE_PROTO and head[1:2] in _PICKLE_VERSIONS)
    if pickled and not looks_safe:
        raise UnsafeFileError(
            f"{path} is a pickle file (torch.save or TorchScript); loading it would run whatever code it "
            "contains, so qp.load refuses it. qp.load reads only the .safetensors files written by "
            "qp.save. A float state_dict (the usual .pt) loads into your model with "
            "model.load_state_dict(torch.load(path, weights_only=True)); quantize that model and qp.save "
            "the result", path=str(path))
    if header is None:
        raise SerializationError(f"{path} is not a qplug artifact: {size} bytes is too short for a "
                                 "safetensors file", path=str(path))
    if header > MAX_HEADER_BYTES:
        raise SerializationError(f"{path} is corrupt or not a safetensors file: it declares a "
                                 f"{header}-byte header (at most {MAX_HEADER_BYTES})", path=str(path))
    if 8 + header > size:
        raise SerializationError(f"{path} is truncated: its header needs {8 + header} bytes but the file "
                                 f"has {size}; copy the file again", path=str(path))
    if head[8:9] != b"{":
        raise SerializationError(f"{path} is corrupt or not a safetensors file: the header is not a "
                                 "JSON object", path=str(path))
