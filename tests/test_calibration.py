"""The calibration loader: errors name file:line, chat rows get the model's template, sources mix by
weight, the hash is stable, long samples are truncated with a warning. Fast: torch only where a real
tokenizer is needed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from quantpipe import calibration as cal
from quantpipe.recipe import Calibration
from quantpipe.stages import StageError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cfg(*sources, **kw) -> Calibration:
    return Calibration(sources=[s if isinstance(s, dict) else {"path": str(s)} for s in sources], **kw)


def texts(n: int, prefix: str = "t") -> list[dict]:
    return [{"text": f"{prefix}{i} some words here"} for i in range(n)]


# --- errors name the file and line ----------------------------------------------------------------


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "cal.jsonl", [{"text": "fine"}, "", '{"text": "broken"', {"text": "ok"}])
    with pytest.raises(StageError, match=rf"{p}:3: not valid JSON"):
        cal.select(cfg(p))


def test_missing_field_names_row(tmp_path):
    p = write_jsonl(tmp_path / "cal.jsonl", [{"text": "a"}, {"prompt": "no text here"}])
    with pytest.raises(StageError, match=rf"{p}:2: no `text` or `messages` field \(it has prompt\)"):
        cal.select(cfg(p))


def test_missing_custom_column(tmp_path):
    p = write_jsonl(tmp_path / "cal.jsonl", [{"body": "a"}, {"text": "b"}])
    with pytest.raises(StageError, match=rf"{p}:2: no field 'body'"):
        cal.select(cfg({"path": str(p), "column": "body"}))


def test_empty_text_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "cal.jsonl", [{"text": "a"}, {"text": "a"}, {"text": "   "}])
    with pytest.raises(StageError, match=rf"{p}:3: empty text"):
        cal.select(cfg(p))


def test_non_utf8_line_named(tmp_path):
    p = tmp_path / "cal.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(StageError, match=rf"{p}:2: not UTF-8"):
        cal.select(cfg(p))


def test_bad_messages_rejected(tmp_path):
    p = write_jsonl(tmp_path / "cal.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(StageError, match=rf"{p}:1: `messages` must be"):
        cal.select(cfg(p))


def test_json_file_rows_named(tmp_path):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps([{"text": "a"}, {"text": 3}]))
    with pytest.raises(StageError, match=rf"{p} row 1: field 'text' must be a string"):
        cal.select(cfg(p))


def test_chat_template_modes_demand_their_field(tmp_path):
    p = write_jsonl(tmp_path / "cal.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}, {"text": "plain"}])
    with pytest.raises(StageError, match=rf"{p}:2: chat_template is `always`"):
        cal.select(cfg(p, chat_template="always"))
    with pytest.raises(StageError, match=rf"{p}:1: chat_template is `never`"):
        cal.select(cfg(p, chat_template="never"))
    rows, _ = cal.select(cfg(p, shuffle=False))
    assert rows[0].messages and rows[1].text == "plain"


def test_check_reports_problems_without_raising(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", texts(3))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}, "{nope"])
    assert cal.check(cfg(good)) == []
    problems = cal.check(cfg(good, bad))
    assert len(problems) == 1 and f"{bad}:2" in problems[0]


def test_loader_module_does_not_import_torch():
    code = "import sys; import quantpipe.calibration; print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


# --- sampling ---------------------------------------------------------------------------------


def test_mixing_by_weight(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", texts(100, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", texts(100, "b"))
    rows, info = cal.select(cfg({"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}, num_samples=40))
    from_a = sum(r.where.startswith(str(a)) for r in rows)
    assert (from_a, len(rows) - from_a) == (30, 10)
    assert [i["taken"] for i in info] == [30, 10]


def test_allocation_sums_to_total():
    for total, w in [(7, [1, 1, 1]), (1, [1, 5]), (10, [0.1, 0.2, 0.7]), (128, [2, 1])]:
        n = cal._allocate(total, w)
        assert sum(n) == total and all(x >= 0 for x in n)


def test_fewer_rows_than_asked_warns_and_uses_all(tmp_path, caplog):
    p = write_jsonl(tmp_path / "a.jsonl", texts(5))
    with caplog.at_level(logging.WARNING, logger="quantpipe.calibration"):
        rows, _ = cal.select(cfg(p, num_samples=32))
    assert len(rows) == 5
    assert "asked for 32 samples" in caplog.text and "using all 5" in caplog.text


def test_empty_source_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [])
    with pytest.raises(StageError, match="no usable rows"):
        cal.select(cfg(p))


def test_seed_and_shuffle(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", texts(200))
    pick = lambda **kw: [r.where for r in cal.select(cfg(p, num_samples=20, **kw))[0]]  # noqa: E731
    assert pick(seed=1) == pick(seed=1)
    assert pick(seed=1) != pick(seed=2)
    assert pick(shuffle=False) == [f"{p}:{i}" for i in range(1, 21)]


# --- templating, tokenizing, hashing (a real, tiny tokenizer) -------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    words = "<s> </s> <unk> hello world some words here user assistant : a b c the quick brown fox".split()
    tok = Tokenizer(
        models.WordLevel(
            {w: i for i, w in enumerate(words)} | {f"t{i}": 100 + i for i in range(300)}, unk_token="<unk>"
        )
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    t.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    return t


def test_chat_rows_get_the_template_and_one_bos(tmp_path, tokenizer):
    p = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]},
            {"text": "hello world"},
        ],
    )
    prep = cal.prepare(cfg(p, shuffle=False), tokenizer)
    assert tokenizer.decode(prep.input_ids[0]) == "<s> user : hello assistant : world"
    assert prep.input_ids[0].count(0) == 1  # the template's BOS, not a second one from add_special_tokens
    assert prep.input_ids[1] == [0, 3, 4]  # plain text: tokenizer adds BOS
    assert prep.provenance(cfg(p, shuffle=False))["n_chat_samples"] == 1


def test_chat_rows_without_a_template_fail_clearly(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>")
    bare.chat_template = None
    with pytest.raises(StageError, match=rf"{p}:1: .*has no chat template"):
        cal.prepare(cfg(p), bare)


def test_truncation_warns_with_count(tmp_path, tokenizer, caplog):
    long = " ".join(["the"] * 40)
    p = write_jsonl(tmp_path / "a.jsonl", [{"text": long}, {"text": "hello"}, {"text": long}])
    with caplog.at_level(logging.WARNING, logger="quantpipe.calibration"):
        prep = cal.prepare(cfg(p, max_seq_len=16), tokenizer)
    assert prep.truncated == 2 and max(map(len, prep.input_ids)) == 16
    assert "2 of 3 samples were longer than max_seq_len=16" in caplog.text


def test_hash_stable_and_sensitive(tmp_path, tokenizer):
    p = write_jsonl(
        tmp_path / "a.jsonl", [{"text": f"t{i} the quick brown fox the quick brown fox"} for i in range(50)]
    )
    h1 = cal.prepare(cfg(p, num_samples=10, seed=3), tokenizer).sha256
    assert h1 == cal.prepare(cfg(p, num_samples=10, seed=3), tokenizer).sha256
    assert h1 != cal.prepare(cfg(p, num_samples=10, seed=4), tokenizer).sha256
    assert h1 != cal.prepare(cfg(p, num_samples=10, seed=3, max_seq_len=8), tokenizer).sha256
    # length-prefixed: the same ids split differently hash differently
    assert cal.ids_sha256([[1, 2], [3]]) != cal.ids_sha256([[1], [2, 3]])


def test_hub_dataset_offline_is_a_stage_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(StageError, match=r"cannot load hub dataset 'nobody/nothing'.*HF_HUB_OFFLINE.*give `path:`"):
        cal.select(cfg({"dataset": "nobody/nothing"}))


def test_dataset_source_read_lazily_skipping_empty_rows(tmp_path, monkeypatch, caplog):
    # a local folder stands in for a hub dataset id: the same `datasets.load_dataset` path, no network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    ds = tmp_path / "ds"
    ds.mkdir()
    write_jsonl(ds / "train.jsonl", [{"text": "" if i % 3 == 0 else f"row {i}"} for i in range(30)])
    with caplog.at_level(logging.WARNING, logger="quantpipe.calibration"):
        rows, info = cal.select(cfg({"dataset": str(ds)}, num_samples=8, shuffle=False))
    assert [r.text for r in rows] == [f"row {i}" for i in range(30) if i % 3][:8]
    assert rows[0].where == f"{ds}[train] row 1"
    assert info[0]["rows"] == 30 and info[0]["taken"] == 8
    assert "skipped 4 empty rows" in caplog.text
