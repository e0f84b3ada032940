"""Reading the small JSON files jmegatron meets (run configs, Hugging Face configs and
indexes, tokenizer configs, token-folder metas): one line naming the file when one is
not a JSON object. Depends on nothing of jmegatron's."""

from __future__ import annotations

import json
from pathlib import Path


def json_object(path: Path, error: type[Exception] = ValueError, hint: str = "") -> dict:
    """The JSON object in ``path``.

    Args:
      path: the file.
      error: the exception class raised (the caller's error type).
      hint: appended to the message (what to do, or what the file should be).

    Raises:
      ``error``: the file cannot be read, is not UTF-8 JSON, or holds no object;
        one line naming it and the parser's reason.
    """
    try:
        value = json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as err:   # ValueError: JSONDecodeError, UnicodeDecodeError
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise error(f"{path} is not readable JSON ({reason}){hint}") from None
    if not isinstance(value, dict):
        raise error(f"{path} is not a JSON object{hint}")
    return value
