"""Reading safetensors files, checked, for ``jmegatron.models.hf``.

A safetensors file is an 8-byte little-endian header length, that much JSON
(tensor name -> dtype, shape, data_offsets), then the data. Every header entry
is checked against the file's size before any read, so a truncated or damaged
file is refused with one line naming it; tensors are memory-mapped by name and
a block with NaN or infinite values is refused when read. A folder holds one
``model.safetensors`` or shards named by ``model.safetensors.index.json``.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path, PurePosixPath

import ml_dtypes
import numpy as np

from jmegatron.jsonfile import json_object

INDEX = "model.safetensors.index.json"
# Stored dtypes read (safetensors' numpy reader has no bfloat16, which most
# published checkpoints use; ml_dtypes, installed with jax, has).
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class HFError(ValueError):
    """A Hugging Face folder jmegatron cannot read or write; the message names the field,
    file or tensor."""


def model_file(folder: Path, name: str) -> Path:
    """The path of file ``name`` in model folder ``folder``.

    Args:
      folder: a Hugging Face model folder.
      name: a file's name inside it.

    Returns:
      ``folder / name``.

    Raises:
      HFError: no such file; the message names the folder and file.
    """
    if not (folder / name).is_file():
        raise HFError(f"{folder}: no {name} (a Hugging Face model folder has config.json "
                      "and *.safetensors)")
    return folder / name


def read_json(file: Path) -> dict:
    """The JSON object in ``file``; HFError (one line naming it) if it is not one."""
    return json_object(file, HFError)


def tensor_names(file: Path) -> list[str]:
    """The tensors a safetensors file holds.

    Args:
      file: the safetensors file's path.

    Returns:
      Their names, in the header's order (metadata left out).
    """
    return list(_header(file)[0])


def _header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its
    data starts: an 8-byte little-endian length, then that much JSON, then the data.
    Every entry is checked against the file's size, so a read never runs past it."""
    total = file.stat().st_size
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if total < 8:
            raise HFError(f"{file}: truncated safetensors file ({total} bytes, shorter than "
                          "its 8-byte header length)")
        if size > total - 8:
            raise HFError(f"{file}: safetensors header length {size} is larger than the file "
                          f"({total} bytes): a truncated or damaged file")
        try:
            header = json.loads(f.read(size))
        except ValueError:   # JSONDecodeError, UnicodeDecodeError
            header = None
    if not isinstance(header, dict):
        raise HFError(f"{file}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        _check_entry(file, name, entry, total - 8 - size)
    return header, 8 + size


def _check_entry(file: Path, name: str, entry, data_bytes: int) -> None:
    """One header entry names a dtype, a shape and data inside the file, as many bytes
    as its shape and (readable) dtype need."""
    try:
        dtype, shape = entry["dtype"], [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
    except (TypeError, KeyError, ValueError):
        dtype = None
    if not isinstance(dtype, str):
        raise HFError(f"{file}: tensor {name} has no dtype, shape and data_offsets in the "
                      "header")
    if not 0 <= begin <= end <= data_bytes:
        raise HFError(f"{file}: tensor {name}'s data_offsets [{begin}, {end}] lie beyond the "
                      f"file's {data_bytes} data bytes (a truncated or damaged file)")
    need = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize if dtype in _DTYPES else None
    if need is not None and end - begin != need:
        raise HFError(f"{file}: tensor {name} has {end - begin} bytes, its shape "
                      f"{tuple(shape)} and dtype {dtype} need {need}")


class Tensors:
    """The tensors of a folder's safetensors files, memory-mapped by name and read
    in fp32 (only the pages a read touches come from disk).

    Args:
      folder: a Hugging Face model folder (``model.safetensors``, or shards and
        their index); every file's header is read and checked here.
    """

    def __init__(self, folder: Path):
        if (folder / INDEX).is_file():
            files = _shard_files(folder / INDEX)
        else:
            files = {model_file(folder, "model.safetensors").name}
        self.entries, self.folder = {}, folder
        for file in sorted(files):
            header, start = _header(model_file(folder, file))
            for name, entry in header.items():
                self.entries[name] = (folder / file, entry["dtype"], tuple(entry["shape"]),
                                      start + int(entry["data_offsets"][0]))
        self.get = functools.lru_cache(maxsize=16)(lambda name: self.rows(name, slice(None)))

    def _mapped(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise HFError(f"{self.folder}: tensor {name} is missing")
        file, dtype, shape, offset = self.entries[name]
        if dtype not in _DTYPES:
            raise HFError(f"{self.folder}: tensor {name} has dtype {dtype}; readable: "
                          f"{', '.join(_DTYPES)}")
        return np.memmap(file, _DTYPES[dtype], mode="r", offset=offset, shape=shape)

    def rows(self, name: str, rows: slice) -> np.ndarray:
        """Rows of a tensor in fp32, read from the file alone; refused (HFError naming
        the tensor and file) if any is NaN or infinite, so no such weight is trained."""
        block = np.asarray(self._mapped(name)[rows], np.float32)
        # min and max are NaN or inf when any value is: two passes, no temporary.
        if block.size and not (np.isfinite(block.min()) and np.isfinite(block.max())):
            raise HFError(f"{name} in {self.entries[name][0]} has non-finite values")
        return block

    def shape(self, name: str) -> tuple[int, ...]:
        return self._mapped(name).shape


def _shard_files(index: Path) -> set[str]:
    """The files an index's weight_map names, each a path inside the model folder:
    one that climbs out (``..``) or is absolute is refused before any file is opened.
    Checked on the names alone: a hub cache's shards are links to files elsewhere."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFError(f"{index} has no weight_map (tensor name -> safetensors file)")
    for name, file in weight_map.items():
        parts = PurePosixPath(file).parts if isinstance(file, str) else ()
        if not parts or file.startswith("/") or ".." in parts:
            raise HFError(f"{index}: weight_map entry {name} -> {file!r} is not a file inside "
                          "the model folder")
    return set(weight_map.values())
