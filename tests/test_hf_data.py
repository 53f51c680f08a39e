"""asyncflow_hf.assets and asyncflow_hf.data: the synthetic GSM8K data, the tokenizer built
here, the local model folder, prompts from local JSONL/parquet files (offline, with errors
that name the file, the field and the row) and their rendering to token ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
datasets = pytest.importorskip("datasets", reason="the [hf] extra is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="the [hf] extra is not installed")
pa = pytest.importorskip("pyarrow", reason="the [hf] extra is not installed")

from asyncflow_hf.assets import (  # noqa: E402
    BOS,
    EOS,
    IM_START,
    PAD,
    build_tokenizer,
    gsm8k_rows,
    make_model_folder,
    write_gsm8k_jsonl,
)
from asyncflow_hf.data import Prompt, load_prompts, render_prompt  # noqa: E402
from asyncflow_hf.models import load_causal_lm  # noqa: E402

from asyncflow_core.contracts.errors import ConfigError  # noqa: E402

TRICKY = [
    "Tom has 123 apples.\n#### 15",
    "héllo wörld  12,345.6 -7",
    " leading space, then\ttab and (parentheses) $5",
    "e\u0301t\u00e9 \\boxed{42}\n\n",
    f"{IM_START}user\nhi{EOS}",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("hf") / "tiny", tokenizer=tok, seed=1)


def test_importing_the_modules_imports_no_hf_library() -> None:
    code = (
        "import sys, asyncflow_hf.assets, asyncflow_hf.data, asyncflow_hf.reward\n"
        "print(sorted(m for m in ('transformers', 'datasets', 'tokenizers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# Synthetic GSM8K data
# --------------------------------------------------------------------------------------------
STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_generated_rows_are_gsm8k_with_correct_arithmetic(difficulty: int) -> None:
    rows = gsm8k_rows(300, seed=5, difficulty=difficulty, max_number=20)
    assert len(rows) == 300
    ops = set()
    for row in rows:
        assert set(row) == {"question", "answer"}
        *reasoning, final = row["answer"].split("\n")
        assert final.startswith("#### ")
        steps = [STEP.search(line) for line in reasoning]
        assert all(steps) and len(steps) == (2 if difficulty == 3 else 1)
        for m in steps:
            assert m is not None
            a, op, b, result = int(m[1]), m[2], int(m[3]), int(m[4])
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] == result
            assert op != "/" or a % b == 0
            ops.add(op)
            if m is steps[0]:  # the first step's operands are the question's numbers
                assert str(a) in row["question"] and str(b) in row["question"]
        assert int(final[5:]) == int(steps[-1][4]) >= 2  # type: ignore[index]
    operands = [int(n) for row in rows for n in re.findall(r"\d+", row["question"])]
    assert max(operands) < 20 * 10  # a total to share may be a product of two factors < 10
    expected_ops = {1: {"+", "-"}, 2: {"+", "-", "*", "/"}, 3: {"+", "-", "*"}}[difficulty]
    assert ops == expected_ops


def test_generator_is_deterministic_and_seeded() -> None:
    assert gsm8k_rows(50, seed=1) == gsm8k_rows(50, seed=1)
    assert gsm8k_rows(50, seed=1) != gsm8k_rows(50, seed=2)
    assert gsm8k_rows(10, seed=1) == gsm8k_rows(50, seed=1)[:10]  # a prefix
    assert gsm8k_rows(0) == []
    small = gsm8k_rows(200, seed=0, difficulty=1, max_number=6)
    assert max(int(n) for r in small for n in re.findall(r"\d+", r["question"])) < 6


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"n": -1}, "n must be an int >= 0"),
        ({"n": 2.0}, "n must be an int >= 0"),
        ({"n": 1, "difficulty": 4}, "difficulty must be one of"),
        ({"n": 1, "max_number": 4}, "max_number must be an int >= 5"),
        ({"n": 1, "seed": "a"}, "seed must be an int"),
    ],
)
def test_generator_refuses_bad_arguments(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        gsm8k_rows(**kwargs)


def test_write_gsm8k_jsonl_round_trips_through_load_prompts(tmp_path: Path) -> None:
    path = write_gsm8k_jsonl(tmp_path / "sub" / "train.jsonl", 25, seed=4, difficulty=2)
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == gsm8k_rows(25, seed=4, difficulty=2)
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"]  # no temporary left
    prompts = load_prompts(path)
    assert [p.row for p in prompts] == gsm8k_rows(25, seed=4, difficulty=2)
    assert [p.content for p in prompts] == [p.row["question"] for p in prompts]
    assert [p.index for p in prompts] == list(range(25))


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------
def test_tokenizer_specials_and_size(tok: Any) -> None:
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    ids = [tok.pad_token_id, tok.bos_token_id, tok.convert_tokens_to_ids(IM_START)]
    ids.append(tok.eos_token_id)
    assert ids == [0, 1, 2, 3]
    assert 300 < len(tok) <= 512  # training stops when no pair is left to merge


def test_digits_are_one_token_each(tok: Any) -> None:
    for n in [0, 7, 10, 19, 123, 2026, 99999]:
        pieces = tok.convert_ids_to_tokens(tok(f"Tom has {n}", add_special_tokens=False).input_ids)
        assert pieces == ["Tom", "Ġhas", "Ġ", *str(n)]
    assert tok.decode(tok("has 1,234.5").input_ids, skip_special_tokens=True) == "has 1,234.5"


def test_generator_words_are_single_tokens_and_text_round_trips(tok: Any) -> None:
    for row in gsm8k_rows(50, seed=9, difficulty=3):
        for text in (row["question"], row["answer"]):
            ids = tok(text, add_special_tokens=False).input_ids
            assert tok.decode(ids) == text
            words = re.findall(r"[A-Za-z]+", text)
            assert len([t for t in tok.convert_ids_to_tokens(ids) if t.strip("Ġ").isalpha()]) == (
                len(words)
            )
    for text in TRICKY:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text.replace("e\u0301", "\u00e9")  # NFC, as Qwen2's


def test_tokenizer_is_deterministic(tok: Any) -> None:
    again = build_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert [again(t).input_ids for t in TRICKY] == [tok(t).input_ids for t in TRICKY]
    custom = build_tokenizer(["zebra zebra zebra quokka"] * 20, vocab_size=300)
    assert custom.convert_ids_to_tokens(custom("zebra", add_special_tokens=False).input_ids) == [
        "zebra"
    ]
    with pytest.raises(ConfigError, match="vocab_size must be an int >= 300"):
        build_tokenizer(vocab_size=100)
    with pytest.raises(ConfigError, match=r"texts\[1\] is int, not a string"):
        build_tokenizer(["a", 1])  # type: ignore[list-item]


def test_chat_template_renders_chatml(tok: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tom has 3 apples."},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"{BOS}{IM_START}system\nBe brief.{EOS}\n{IM_START}user\nTom has 3 apples.{EOS}\n"
        f"{IM_START}assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == text.removesuffix(f"{IM_START}assistant\n")
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_tokenizer_round_trips_through_save_pretrained(tok: Any, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.chat_template == tok.chat_template
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (3, 0, len(tok))
    assert [loaded(t).input_ids for t in TRICKY] == [tok(t).input_ids for t in TRICKY]


# --------------------------------------------------------------------------------------------
# The model folder
# --------------------------------------------------------------------------------------------
def test_model_folder_is_complete_and_loads_offline(tok: Any, model_folder: Path) -> None:
    names = sorted(p.name for p in model_folder.iterdir())
    assert names == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    generation = json.loads((model_folder / "generation_config.json").read_text())
    generation.pop("transformers_version")
    assert generation == {"bos_token_id": 1, "eos_token_id": 3, "pad_token_id": 0}
    assert not [p for p in model_folder.parent.iterdir() if p.name.startswith(".")]
    model = load_causal_lm(model_folder, who="test")
    assert model.config.vocab_size == len(tok)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (3, 0)
    model2 = load_causal_lm(model_folder, who="test")
    assert all(
        (a == b).all()
        for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-llama"])
def test_auto_tokenizer_from_a_model_folder_encodes_like_the_built_one(
    tok: Any, model_folder: Path, model: str, tmp_path: Path
) -> None:
    # transformers loads any model_type "qwen2" folder as Qwen2Tokenizer, which rebuilds the
    # pre-tokenizer and adds an unk token of its own: neither may change a single id
    folder = (
        model_folder
        if model == "tiny-qwen2"
        else make_model_folder(tmp_path / "m", model=model, tokenizer=tok)
    )
    loaded = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(loaded) == len(tok) == json.loads((folder / "config.json").read_text())["vocab_size"]
    assert [loaded(t).input_ids for t in TRICKY] == [tok(t).input_ids for t in TRICKY]
    messages = [{"role": "user", "content": TRICKY[1]}]
    assert render_prompt(messages, loaded) == render_prompt(messages, tok)


def test_make_model_folder_refuses_a_used_path_and_leaves_nothing_on_failure(
    tok: Any, tmp_path: Path
) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not an empty folder"):
        make_model_folder(used, tokenizer=tok)
    assert [p.name for p in used.iterdir()] == ["x"]
    with pytest.raises(ConfigError, match="unknown tiny model 'tiny-gpt'"):
        make_model_folder(tmp_path / "new", model="tiny-gpt", tokenizer=tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch", "used"]


# --------------------------------------------------------------------------------------------
# load_prompts
# --------------------------------------------------------------------------------------------
def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"question": f"q{i}?", "answer": f"#### {i}", "source": "test"} for i in range(6)]


@pytest.fixture(autouse=True)
def private_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """load_prompts' scratch folders go under this test's own temporary folder."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield scratch


def test_load_prompts_from_jsonl_keeps_every_field(tmp_path: Path, private_tempdir: Path) -> None:
    prompts = load_prompts(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert prompts == [Prompt(i, f"q{i}?", row) for i, row in enumerate(ROWS)]
    assert list(private_tempdir.iterdir()) == []  # the parse cache was removed


def test_load_prompts_from_parquet_with_limit_and_split_slices(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert [p.content for p in load_prompts(path, limit=2)] == ["q0?", "q1?"]
    assert [p.content for p in load_prompts(path, split="train[4:]")] == ["q4?", "q5?"]
    with pytest.raises(ConfigError, match=r"data\.limit must be an int >= 1"):
        load_prompts(path, limit=0)


def test_load_prompts_from_a_folder_by_split(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "train.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "data" / "test.jsonl", ROWS[4:])
    assert [p.content for p in load_prompts(tmp_path / "data")] == ["q0?", "q1?", "q2?", "q3?"]
    assert [p.content for p in load_prompts(tmp_path / "data", split="test")] == ["q4?", "q5?"]
    with pytest.raises(ConfigError, match=r"data.split='validation': Unknown split"):
        load_prompts(tmp_path / "data", split="validation")


def test_load_prompts_with_a_cache_dir_writes_there(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    load_prompts(write_jsonl(tmp_path / "d.jsonl", ROWS), cache_dir=cache)
    assert any(cache.rglob("*.arrow"))


def test_load_prompts_runs_with_the_hub_off_and_restores_the_switches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    before = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    seen: list[object] = []
    real = datasets.load_dataset

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.extend(
            [
                os.environ.get("HF_HUB_OFFLINE"),
                os.environ.get("HF_DATASETS_OFFLINE"),
                datasets.config.HF_HUB_OFFLINE,
                hub.HF_HUB_OFFLINE,
            ]
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    load_prompts(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert seen == ["1", "1", True, True]
    assert "HF_HUB_OFFLINE" not in os.environ
    assert os.environ["HF_DATASETS_OFFLINE"] == "0"
    assert before == (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)


@pytest.mark.parametrize("path", ["openai/gsm8k", "hf://datasets/openai/gsm8k", "missing.jsonl"])
def test_load_prompts_refuses_what_is_not_a_local_file(path: str) -> None:
    with pytest.raises(ConfigError, match=r"does not exist.*never downloaded from the hub"):
        load_prompts(path)


def test_load_prompts_refuses_other_formats_and_mixed_or_empty_folders(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("question,answer\nq,1\n")
    with pytest.raises(ConfigError, match=r"has suffix '.csv'; data.path must be"):
        load_prompts(tmp_path / "d.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no data files"):
        load_prompts(tmp_path / "empty")
    write_jsonl(tmp_path / "mixed" / "train.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "mixed" / "test.parquet")
    with pytest.raises(ConfigError, match="holds both JSON and parquet data files"):
        load_prompts(tmp_path / "mixed")


def test_load_prompts_names_a_file_it_cannot_parse(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a"\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl': datasets could not read it as json"):
        load_prompts(bad)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet': datasets could not read it as parquet"):
        load_prompts(tmp_path / "bad.parquet")


def test_load_prompts_names_a_missing_field_and_the_fields_there_are(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"data file '{path}' has no field 'question' (fields: ['prompt', 'answer']); "
            "set data.prompt_field="
        ),
    ):
        load_prompts(path)
    assert [p.content for p in load_prompts(path, prompt_field="prompt")] == ["p"]
    with pytest.raises(ConfigError, match=r"no field 'solution' .*set data.answer_field="):
        load_prompts(path, prompt_field="prompt", answer_field="solution")
    with pytest.raises(ConfigError, match=r"no field 'messages' .*set data.messages_field="):
        load_prompts(path, messages_field="messages")
    no_answer = write_jsonl(tmp_path / "y.jsonl", [{"question": "q"}])
    assert [p.row for p in load_prompts(no_answer, answer_field=None)] == [{"question": "q"}]


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "None (NoneType)"), (7, "7 (int)"), ("  ", "'  ' (str)")]
)
def test_load_prompts_names_a_row_whose_prompt_is_not_text(
    tmp_path: Path, value: object, shown: str
) -> None:
    rows = [{"question": "fine", "answer": "1"}, {"question": value, "answer": "2"}]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(
        ConfigError, match=re.escape(f"row 1: field 'question' is {shown}; a prompt must be")
    ):
        load_prompts(path)


def test_load_prompts_reads_chat_messages(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "answer": "1"},
        {
            "messages": [
                {"role": "system", "content": "Be brief.", "name": "policy"},
                {"role": "user", "content": "2 + 2?"},
            ],
            "answer": "4",
        },
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    prompts = load_prompts(path, messages_field="messages")
    assert prompts[0].content == ({"role": "user", "content": "hi"},)  # no name: None dropped
    assert prompts[1].content == (
        {"role": "system", "content": "Be brief.", "name": "policy"},
        {"role": "user", "content": "2 + 2?"},
    )
    assert prompts[1].row["answer"] == "4"


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ("hi", "field 'messages' is 'hi'; it must be a non-empty list"),
        ([], "field 'messages' is \\[\\]; it must be a non-empty list"),
        ([{"role": "user"}], "field 'messages': message 0 has content=None; it must be"),
        (
            [{"role": "user", "content": "a"}, {"role": 3, "content": "b"}],
            "field 'messages': message 1 has role=3",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "field 'messages' ends with an assistant message",
        ),
    ],
)
def test_load_prompts_names_a_row_with_malformed_messages(
    tmp_path: Path, messages: object, expected: str
) -> None:
    rows = [{"messages": [{"role": "user", "content": "ok"}]}, {"messages": messages}]
    # one file per row shape: a JSON column must have one type across rows for datasets
    path = write_jsonl(tmp_path / "chat.jsonl", rows[1:])
    with pytest.raises(ConfigError, match=f"row 0: {expected}"):
        load_prompts(path, messages_field="messages", answer_field=None)


# --------------------------------------------------------------------------------------------
# render_prompt
# --------------------------------------------------------------------------------------------
def test_render_prompt_with_the_chat_template(tok: Any) -> None:
    prompt = Prompt(0, "Tom has 3 apples.", {"question": "Tom has 3 apples."})

    def text(ids: list[int]) -> str:
        return str(tok.decode(ids))

    user = f"{IM_START}user\nTom has 3 apples.{EOS}\n"
    opening = f"{IM_START}assistant\n"
    assert text(render_prompt(prompt, tok)) == f"{BOS}{user}{opening}"
    assert text(render_prompt(prompt, tok, system_prompt="Be brief.")) == (
        f"{BOS}{IM_START}system\nBe brief.{EOS}\n{user}{opening}"
    )
    own = (
        {"role": "system", "content": "Mine."},
        {"role": "user", "content": "Tom has 3 apples."},
    )
    assert text(render_prompt(own, tok, system_prompt="Be brief.")) == (
        f"{BOS}{IM_START}system\nMine.{EOS}\n{user}{opening}"
    )
    assert render_prompt("Tom has 3 apples.", tok) == render_prompt(prompt, tok)


@pytest.fixture(scope="module")
def plain_tok(tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("plain")
    tok.save_pretrained(folder)
    plain = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    plain.chat_template = None
    return plain


def test_render_prompt_without_a_chat_template(plain_tok: Any) -> None:
    ids = render_prompt(Prompt(3, "Tom has 3 apples.", {}), plain_tok)
    assert ids == plain_tok("Tom has 3 apples.").input_ids
    assert plain_tok.decode(ids) == f"{BOS}Tom has 3 apples."
    with_system = render_prompt("Tom has 3 apples.", plain_tok, system_prompt="Be brief.")
    assert plain_tok.decode(with_system) == f"{BOS}Be brief.\n\nTom has 3 apples."
    messages = ({"role": "user", "content": "hi"},)
    with pytest.raises(ConfigError, match="prompt 3 is chat messages but the tokenizer has no"):
        render_prompt(Prompt(3, messages, {}), plain_tok)


def test_render_prompt_refuses_a_bad_system_prompt(tok: Any) -> None:
    with pytest.raises(ConfigError, match="system_prompt must be a string or None"):
        render_prompt("hi", tok, system_prompt=3)  # type: ignore[arg-type]
