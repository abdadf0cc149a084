"""Reading records: each malformed input fails with its own one-line message."""

from __future__ import annotations

import importlib.util
import os

import pytest

from jaxrlhf.data import DataConfig, DataError, TokenizerConfig, load_datasets, load_tokenizer
from jaxrlhf.data.sources import read_records
from tests.data.fixtures import write_jsonl


def test_jsonl_reads_objects_and_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, "", {"x": 1}])
    assert read_records(path) == [{"prompt": "a", "response": "b"}, {"x": 1}]


def test_malformed_jsonl_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, '{"prompt": "b",}'])
    with pytest.raises(DataError) as e:
        read_records(path)
    assert str(e.value) == (
        f"{path}:2: malformed JSON line (Expecting property name enclosed in double quotes"
        " at column 16)"
    )


def test_jsonl_line_that_is_not_utf8(tmp_path):
    path = tmp_path / "d.jsonl"
    # Line 2 is Latin-1: "café" with é as the single byte 0xe9 (UTF-8 would be 0xc3 0xa9).
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError) as e:
        read_records(str(path))
    # Column 16: '{"prompt": "caf' is 15 bytes, so 0xe9 is the 16th.
    assert str(e.value) == (
        f"{path}:2: not UTF-8 text (byte 0xe9 at column 16); convert the file to UTF-8"
    )


def test_jsonl_with_byte_order_mark(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n')
    assert read_records(str(path)) == [{"prompt": "a"}, {"prompt": "b"}]


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, "[1, 2]"])
    with pytest.raises(DataError, match=r":2: expected a JSON object, got list$"):
        read_records(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError) as e:
        read_records(str(path))
    assert str(e.value) == f"{path}: empty file, no records"


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file$"):
        read_records(str(tmp_path / "nope.jsonl"))
    other = tmp_path / "d.csv"
    other.write_text("a,b\n")
    with pytest.raises(DataError, match=r"d\.csv: unknown data format \(expected \.jsonl"):
        read_records(str(other))


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow installed")
def test_parquet_without_pyarrow_names_the_package(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError) as e:
        read_records(str(path))
    assert str(e.value) == (
        f"{path}: reading Parquet needs pyarrow, which is not installed (pip install pyarrow)"
    )


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets installed")
def test_saved_dataset_without_datasets_names_the_package(tmp_path):
    with pytest.raises(DataError, match=r"needs the datasets package, which is not installed"):
        read_records(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_records(str(tmp_path / "d.parquet")) == rows


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets")
def test_saved_dataset_dict_split(tmp_path):
    import datasets

    rows = {"prompt": ["p"], "response": ["r"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path)
    assert read_records(str(tmp_path), "train") == [{"prompt": "p", "response": "r"}]
    with pytest.raises(DataError, match=r"no split 'test'"):
        read_records(str(tmp_path), "test")


def test_no_usable_records_is_a_clear_error(tmp_path):
    path = write_jsonl(
        tmp_path / "prefs.jsonl",
        [
            {"prompt": "a", "chosen": "b"},
            {"prompt": "a", "chosen": "b"},
            {"prompt": " ", "chosen": "b", "rejected": "c"},
        ],
    )
    cfg = DataConfig(train=path, eval_size=0, max_length=32, max_prompt_length=16)
    tok_cfg = TokenizerConfig()
    with pytest.raises(DataError) as e:
        load_datasets("preference", cfg, load_tokenizer(tok_cfg), tok_cfg)
    assert str(e.value) == (
        f"no usable records: {path}: 0 of 3 records kept; 3 bad (2 missing field 'rejected',"
        " 1 empty text in 'prompt')"
    )


def test_eval_split_must_leave_training_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}] * 3)
    cfg = DataConfig(train=path, eval_size=3, max_length=32, max_prompt_length=16)
    tok_cfg = TokenizerConfig()
    with pytest.raises(DataError, match=r"data.eval_size 3 leaves no training records out of 3"):
        load_datasets("sft", cfg, load_tokenizer(tok_cfg), tok_cfg)


def test_tokenizer_dir_must_exist(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer.path: .* is not a directory"):
        load_tokenizer(TokenizerConfig(path=os.path.join(tmp_path, "none")))


def test_tokenizer_dir_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # e.g. a model export without its tokenizer
    with pytest.raises(DataError) as e:
        load_tokenizer(TokenizerConfig(path=str(tmp_path)))
    assert str(e.value) == (
        f"tokenizer.path: {tmp_path} holds no tokenizer files (expected tokenizer.json, "
        "tokenizer_config.json, vocab.json, vocab.txt, *.model or *.tiktoken; found "
        "['config.json']); save one there with "
        "AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR)"
    )
    os.remove(tmp_path / "config.json")
    with pytest.raises(DataError, match=r"holds no tokenizer files .*; found nothing\)"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path)))


def test_tokenizer_load_error_is_one_whole_line(tmp_path):
    # A config but no vocabulary: transformers' message spans five lines ("... from one
    # of:\n(1) ...\n(2) ..."); all of it is kept, on one line.
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(DataError) as e:
        load_tokenizer(TokenizerConfig(path=str(tmp_path)))
    message = str(e.value)
    assert message.startswith(f"tokenizer.path: cannot load a tokenizer from {tmp_path}: ")
    assert "\n" not in message and "from one of: (1) " in message and "(3) " in message
