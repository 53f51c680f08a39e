"""Prompts from local dataset files: a JSONL or parquet file (or a folder of them) read through
``datasets`` with the hub switched off, each row checked and kept whole for the reward, and
rendered to token ids with the tokenizer's chat template when it has one."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow_core.contracts.errors import ConfigError
from asyncflow_core.engines.enginekit import is_int, require_module
from asyncflow_hf.compat import INSTALL

__all__ = ["FORMATS", "Message", "Prompt", "load_prompts", "render_prompt"]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffixes ``load_prompts`` reads, and the ``datasets`` builder of each."""

Message = Mapping[str, Any]
"""A chat message: ``{"role": str, "content": str}`` (other keys kept for the template)."""


@dataclass(frozen=True)
class Prompt:
    """One row of a dataset file as a prompt.

    ``index``: the row's position in the split (from 0); ``content``: the prompt text, or the
    chat messages; ``row``: every field of the row as read (the answer among them), which is
    what a reward receives as ``reward(completion, row)``."""

    index: int
    content: str | tuple[Message, ...]
    row: Mapping[str, Any]


_OFFLINE_LOCK = threading.Lock()
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """The hub switched off (and ``datasets``' progress bars and logs hidden) for the duration: both
    read their offline switch when imported, so the module constants are set with the
    environment, and everything is restored after."""
    hub_constants = require_module("huggingface_hub.constants", who="load_prompts", install=INSTALL)
    with _OFFLINE_LOCK:
        env = {key: os.environ.get(key) for key in _OFFLINE_ENV}
        saved = (
            (datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE),
            (datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE),
            (hub_constants, "HF_HUB_OFFLINE", hub_constants.HF_HUB_OFFLINE),
        )
        bars = datasets.is_progress_bar_enabled()
        verbosity = datasets.logging.get_verbosity()
        try:
            os.environ.update({key: "1" for key in _OFFLINE_ENV})
            for module, name, _ in saved:
                setattr(module, name, True)
            datasets.disable_progress_bars()
            datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # errors reach the caller
            yield
        finally:
            for module, name, value in saved:
                setattr(module, name, value)
            for key, old in env.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
            datasets.logging.set_verbosity(verbosity)
            if bars:
                datasets.enable_progress_bars()


def _data_files(path: str | Path) -> tuple[Path, str, dict[str, Any]]:
    """The local file or folder, its ``datasets`` builder and the ``load_dataset`` arguments
    that name it; ``ConfigError`` for anything that is not a local JSONL/parquet file or a
    folder holding only one of the two."""
    source = Path(path).expanduser()
    accepted = f"a local JSONL or parquet file ({', '.join(FORMATS)}) or a folder of them"
    if not source.exists():
        relative = "" if source.is_absolute() else f" (relative to {os.getcwd()!r})"
        raise ConfigError(
            f"data file {str(path)!r} does not exist{relative}; data.path must be {accepted} "
            "(datasets are never downloaded from the hub)"
        )
    if source.is_file():
        builder = FORMATS.get(source.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"data file {str(source)!r} has suffix {source.suffix!r}; data.path must be "
                f"{accepted}"
            )
        return source, builder, {"data_files": [str(source)]}
    found = {
        FORMATS[f.suffix.lower()]
        for f in source.rglob("*")
        if f.is_file() and f.suffix.lower() in FORMATS and not f.name.startswith(".")
    }
    if len(found) != 1:
        what = "no" if not found else "both JSON and parquet"
        raise ConfigError(
            f"data folder {str(source)!r} holds {what} data files; data.path must be {accepted} "
            "(one format per folder)"
        )
    # datasets infers the splits from the file names (train*.jsonl, test-00000-of-00001.parquet)
    return source, found.pop(), {"data_dir": str(source)}


def _read_rows(
    path: str | Path, split: str, cache_dir: str | Path | None
) -> tuple[Path, list[str], list[dict[str, Any]]]:
    datasets = require_module("datasets", who="load_prompts", install=INSTALL)
    source, builder, files = _data_files(path)
    with tempfile.TemporaryDirectory(prefix="asyncflow-data-") as scratch, _offline(datasets):
        try:
            table = datasets.load_dataset(
                builder, split=split, cache_dir=str(cache_dir or scratch), **files
            )
        except Exception as exc:
            if type(exc) is ValueError:  # datasets' own: an unknown split, a bad slice
                raise ConfigError(
                    f"data file {str(source)!r}: data.split={split!r}: {exc}"
                ) from exc
            cause = exc.__cause__ or exc  # not JSON, not parquet, ... (pyarrow's errors)
            raise ConfigError(
                f"data file {str(source)!r}: datasets could not read it as {builder}: "
                f"{type(cause).__name__}: {cause}"
            ) from exc
        # plain rows now: the memory-mapped arrow files live in the scratch folder
        return source, list(table.column_names), table.to_list()


def _check_field(source: Path, columns: list[str], field: str, key: str, hint: str) -> None:
    if field not in columns:
        raise ConfigError(
            f"data file {str(source)!r} has no field {field!r} (fields: {columns}); "
            f"set data.{key}= to one of them{hint}"
        )


def _messages(source: Path, index: int, field: str, value: object) -> tuple[Message, ...]:
    where = f"data file {str(source)!r}, row {index}: field {field!r}"
    shape = "a non-empty list of {'role': str, 'content': str} messages"
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{where} is {value!r:.80}; it must be {shape}")
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ConfigError(f"{where}: message {j} is {message!r:.80}; it must be {shape}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ConfigError(
                    f"{where}: message {j} has {key}={message.get(key)!r:.80}; it must be {shape}"
                )
        # datasets fills keys that other rows' messages have with None: not part of this one
        messages.append({k: v for k, v in message.items() if v is not None})
    if messages[-1]["role"] == "assistant":
        raise ConfigError(
            f"{where} ends with an assistant message; a prompt ends with the turn the policy "
            "answers (drop the reference answer from the messages)"
        )
    return tuple(messages)


def load_prompts(
    path: str | Path,
    *,
    prompt_field: str = "question",
    messages_field: str | None = None,
    answer_field: str | None = "answer",
    split: str = "train",
    limit: int | None = None,
    cache_dir: str | Path | None = None,
) -> list[Prompt]:
    """The rows of a local dataset file as ``Prompt``s, in file order.

    ``path``: a ``.jsonl``/``.json``/``.parquet`` file, or a folder of one of the two (its
    splits inferred by ``datasets`` from the file names); anything else, hub names included,
    is refused: ``datasets`` runs with the hub switched off. ``split`` is passed to
    ``datasets`` (a single file is the ``train`` split; slices such as ``"train[:100]"``
    work). Each prompt is the string in ``prompt_field``, or, when ``messages_field`` is
    given (it wins over ``prompt_field``), the chat messages in that field. ``answer_field``,
    unless None, must be a column too (the reward reads it). ``limit`` keeps the first rows.
    ``datasets`` caches the parsed file in ``cache_dir``, by default a temporary folder
    removed before returning (nothing is written elsewhere).

    ``ConfigError`` names the file and what is wrong: a missing field with the fields it has,
    a row whose prompt is not a non-empty string (or whose messages are malformed) by its
    index."""
    if limit is not None and (not is_int(limit) or limit < 1):
        raise ConfigError(f"data.limit must be an int >= 1 or None, got {limit!r}")
    source, columns, rows = _read_rows(path, split, cache_dir)
    if messages_field is not None:
        field = messages_field
        _check_field(source, columns, field, "messages_field", " (or data.prompt_field= for text)")
    else:
        field = prompt_field
        _check_field(source, columns, field, "prompt_field", " (or data.messages_field= for chat)")
    if answer_field is not None:
        _check_field(
            source, columns, answer_field, "answer_field", " (or None if the reward needs none)"
        )
    if not rows:
        raise ConfigError(f"data file {str(source)!r} (split {split!r}) has no rows")
    prompts = []
    for index, row in enumerate(rows[:limit]):
        value = row[field]
        content: str | tuple[Message, ...]
        if messages_field is not None:
            content = _messages(source, index, field, value)
        elif isinstance(value, str) and value.strip():
            content = value
        else:
            raise ConfigError(
                f"data file {str(source)!r}, row {index}: field {field!r} is {value!r:.80} "
                f"({type(value).__name__}); a prompt must be a non-empty string"
            )
        prompts.append(Prompt(index, content, row))
    return prompts


def render_prompt(
    prompt: Prompt | str | Sequence[Message], tokenizer: Any, *, system_prompt: str | None = None
) -> list[int]:
    """The token ids the policy continues from.

    With a chat template (``tokenizer.chat_template``): a text prompt becomes one user
    message, ``system_prompt`` (if given, and the messages have no system message of their
    own) goes first, and ``apply_chat_template(..., add_generation_prompt=True)`` opens the
    assistant's turn. Without one: ``tokenizer(text)`` of the text, after ``system_prompt``
    and a blank line if given (special tokens as the tokenizer adds them); chat messages need
    a template and are refused."""
    content = prompt.content if isinstance(prompt, Prompt) else prompt
    where = f"prompt {prompt.index}" if isinstance(prompt, Prompt) else "prompt"
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ConfigError(f"system_prompt must be a string or None, got {system_prompt!r:.80}")
    if getattr(tokenizer, "chat_template", None):
        if isinstance(content, str):
            messages: list[Message] = [{"role": "user", "content": content}]
        else:
            messages = list(content)
        if system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    elif isinstance(content, str):
        text = content if system_prompt is None else f"{system_prompt}\n\n{content}"
        ids = tokenizer(text)["input_ids"]
    else:
        raise ConfigError(
            f"{where} is chat messages but the tokenizer has no chat template; use a tokenizer "
            "with one (a model folder's chat_template.jinja), or a text field "
            "(data.prompt_field)"
        )
    if not ids:
        raise ConfigError(f"{where} renders to no tokens; give a non-empty prompt")
    return [int(t) for t in ids]
