"""SFT data: rendering and loss masks, every source format, clear errors on bad rows, token-budget rows."""

import copy
import json
import re
import sys

import pytest
from transformers import AutoTokenizer

from support.paths import TOY_TRAIN
from lightning_rl.data.sft import DataError, Renderer, TokenBudgetBatchSampler, load_examples, plan_batches
from lightning_rl.models.loading import end_of_turn_ids, template_end_of_turn
from lightning_rl.packing.tree import count_unique_tokens

SYSTEM = {"role": "system", "content": "Be brief."}
GOOD = {"messages": [SYSTEM, {"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained_text(tokenizer, example):
    return tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


def test_messages_train_only_assistant_turns(tiny_tokenizer, tmp_path):
    two_turns = {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "2+3="},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "reverse 1 2"},
            {"role": "assistant", "content": "2 1"},
        ]
    }
    examples, cases = load_examples(write_jsonl(tmp_path / "d.jsonl", [GOOD, two_turns]), Renderer(tiny_tokenizer, "tiny"), 512)
    assert trained_text(tiny_tokenizer, examples[0]) == "5<|im_end|>"
    assert trained_text(tiny_tokenizer, examples[1]) == "5<|im_end|>2 1<|im_end|>"
    # The held-out case is the prompt before the last assistant turn, ending in the generation prompt.
    assert tiny_tokenizer.decode(cases[1].prompt_ids).endswith("reverse 1 2<|im_end|>\n<|im_start|>assistant\n")
    assert cases[1].reference == "2 1"


def test_prompt_completion_strings_and_messages(tiny_tokenizer, tmp_path):
    rows = [
        {"prompt": "12+7=", "completion": "19"},
        {"prompt": [SYSTEM, {"role": "user", "content": "1+1="}], "completion": [{"role": "assistant", "content": "2"}]},
        {"prompt": "1+2=", "completion": "3<|im_end|>"},  # its end token written out: not appended again (TRL's)
    ]
    examples, cases = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), Renderer(tiny_tokenizer, "tiny"), 512)
    # The held-out reference is the reply a greedy decode writes (its end token is not text): "3" for "3<|im_end|>" too.
    assert [case.reference for case in cases] == ["19", "2", "3"]
    assert trained_text(tiny_tokenizer, examples[0]) == "19<|im_end|>"
    assert tiny_tokenizer.decode(examples[0].input_ids) == "12+7=19<|im_end|>"
    assert trained_text(tiny_tokenizer, examples[1]) == "2<|im_end|>"
    assert tiny_tokenizer.decode(examples[2].input_ids) == "1+2=3<|im_end|>" and trained_text(tiny_tokenizer, examples[2]) == "3<|im_end|>"


def test_text_rows_train_their_own_text_with_a_sentencepiece_tokenizer(tmp_path):
    """A SentencePiece tokenizer opens every text it encodes with a word marker: the completion tokenized alone read
    ' Yes.' after the prompt. The tokens that follow the prompt's in the whole row are trained (TRL's); a row whose
    boundary falls inside a token, and whose completion tokenized apart would read otherwise, is refused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    spm.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    spm.train_from_iterator(["Question: two plus two?\nAnswer: four. Hello world. Yes."] * 20,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    spm.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", spm.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    rows = [{"prompt": "Question: two plus two?\n", "completion": "Yes."}, {"prompt": "Answer:", "completion": " four"}]
    examples, _ = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), Renderer(tokenizer, "spm"), 512)
    for row, example in zip(rows, examples):
        assert example.input_ids == tokenizer(row["prompt"] + row["completion"])["input_ids"] + [tokenizer.eos_token_id]
        assert trained_text(tokenizer, example).removesuffix("</s>").strip() == row["completion"].strip()
    assert tokenizer.convert_ids_to_tokens([t for t, m in zip(examples[0].input_ids, examples[0].loss_mask) if m])[0] == "Yes"
    with pytest.raises(DataError, match=r"line 1: tokenizer spm: a token spans the end of `prompt` and the start of "
                                        r"`completion` \('Hello ' \| 'world'\), and the completion tokenized apart reads ' world'"):
        load_examples(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "Hello ", "completion": "world"}]), Renderer(tokenizer, "spm"), 512)


def test_template_without_generation_blocks_gives_the_same_mask(tiny_path, tiny_tokenizer, tmp_path):
    plain = AutoTokenizer.from_pretrained(tiny_path)
    plain.chat_template = plain.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    rows = [json.loads(line) for line in TOY_TRAIN.read_text().splitlines()[:20]]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with_blocks, _ = load_examples(path, Renderer(tiny_tokenizer, "tiny"), 512)
    without, _ = load_examples(path, Renderer(plain, "plain"), 512)
    assert [e.loss_mask for e in without] == [e.loss_mask for e in with_blocks]
    assert [e.input_ids for e in without] == [e.input_ids for e in with_blocks]
    # A conversation that opens with the assistant: nothing before it to render, so its header cannot be located.
    opening = write_jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": "assistant", "content": "Hi!"}, *rows[0]["messages"]]}])
    with pytest.raises(DataError, match=r"o.jsonl: line 1: `messages\[0\]`: a conversation that opens with an assistant turn: .* open with a system or user turn$"):
        load_examples(opening, Renderer(plain, "plain"), 512)
    assert any(load_examples(opening, Renderer(tiny_tokenizer, "tiny"), 512)[0][0].loss_mask)  # located by the blocks


@pytest.mark.parametrize("blocks", [False, True])
def test_a_reply_whose_first_characters_join_the_assistant_header_into_one_token_is_refused(tiny_path, tmp_path, blocks):
    """Qwen's tokenizers hold "\n\n" as one token: the header's newline and a reply opening with one become it, so the
    reply would be trained after tokens the model is never asked with (its prompt ends in the header's "\n"). A
    template's {% generation %} blocks mark the joined token as the reply's all the same."""
    joining = AutoTokenizer.from_pretrained(tiny_path)
    if not blocks:
        joining.chat_template = joining.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    joining.add_tokens(["\n\n"])
    user = {"role": "user", "content": "2+3="}
    rows = [{"messages": [user, {"role": "assistant", "content": "\n5"}]},
            {"prompt": [user], "completion": [{"role": "assistant", "content": "\n5"}]}]
    for line, row in enumerate(rows, 1):
        path = write_jsonl(tmp_path / f"r{line}.jsonl", [row])
        with pytest.raises(DataError, match=rf"r{line}.jsonl: line 1: .* opens with '.*', which the tokenizer joins with the end of the "
                                            "template's assistant header .* remove the reply's leading whitespace$"):
            load_examples(path, Renderer(joining, "joining"), 512)
    # The same reply without its newline, and on a tokenizer that keeps newlines apart, trains as the model is asked.
    stripped = [{"messages": [user, {"role": "assistant", "content": "5"}]}]
    (example,), (case,) = load_examples(write_jsonl(tmp_path / "s.jsonl", stripped), Renderer(joining, "joining"), 512)
    assert example.input_ids[: len(case.prompt_ids)] == case.prompt_ids and trained_text(joining, example) == "5<|im_end|>"
    assert any(load_examples(path, Renderer(AutoTokenizer.from_pretrained(tiny_path), "tiny"), 512)[0][0].loss_mask)


@pytest.mark.parametrize("named_by", ["generation config", "chat template alone"])
def test_a_separator_after_a_reply_end_that_is_not_eos_is_not_trained(tiny_path, tiny_tokenizer, tmp_path, named_by):
    """Gemma ends a reply with ``<end_of_turn>`` (its generation config's end, not the tokenizer's ``<eos>``) and its
    template puts ``\n`` after it: the reply is trained through its end, never the separator, as with blocks. A base
    model's tokenizer (eos ``<|endoftext|>``, generation config naming nothing else) with a ChatML template: its
    template's ``<|im_end|>`` ends the reply all the same."""
    folder = tmp_path / "model"
    gemma_like = AutoTokenizer.from_pretrained(tiny_path)
    gemma_like.chat_template = gemma_like.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    gemma_like.eos_token = "<|endoftext|>"
    gemma_like.save_pretrained(folder)
    ends = [gemma_like.convert_tokens_to_ids("<|endoftext|>"), gemma_like.convert_tokens_to_ids("<|im_end|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends if named_by == "generation config" else ends[:1]}))
    rows = [json.loads(line) for line in TOY_TRAIN.read_text().splitlines()[:5]]
    rows.append({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                              {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]})  # fmt: skip
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with_blocks, _ = load_examples(path, Renderer(tiny_tokenizer, "tiny"), 512)
    without, _ = load_examples(path, Renderer(AutoTokenizer.from_pretrained(folder), str(folder)), 512)
    assert [e.loss_mask for e in without] == [e.loss_mask for e in with_blocks]
    assert trained_text(tiny_tokenizer, without[-1]) == "2<|im_end|>4<|im_end|>"


def test_a_rows_chat_template_kwargs_reach_the_template_as_in_trl(tiny_path, tmp_path):
    """TRL's per-row ``chat_template_kwargs`` column: variables the chat template reads. It was dropped silently."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer.chat_template = "{% if persona is defined %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}" + tokenizer.chat_template
    turns = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    rows = [{"messages": turns, "chat_template_kwargs": {"persona": "a pirate"}}, {"messages": turns},
            {"prompt": turns[:1], "completion": turns[1:], "chat_template_kwargs": {"persona": "a pirate"}}]  # fmt: skip
    (pirate, plain, split), _ = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), Renderer(tokenizer, "tiny"), 512)
    assert tokenizer.decode(pirate.input_ids).startswith("<|im_start|>system\na pirate<|im_end|>\n<|im_start|>user\n1+1=")
    assert tokenizer.decode(plain.input_ids).startswith("<|im_start|>user\n1+1=")
    assert trained_text(tokenizer, pirate) == trained_text(tokenizer, plain) == "2<|im_end|>" and split == pirate
    for bad in ({"tokenize": False}, ["persona"], {"tokenizer_kwargs": {"truncation": True}}):  # the last: 1.2 KB of repr
        with pytest.raises(DataError, match="line 1: `chat_template_kwargs` must be an object of the template's variables"):
            load_examples(write_jsonl(tmp_path / "bad.jsonl", [{"messages": turns, "chat_template_kwargs": bad}]), Renderer(tokenizer, "tiny"), 512)


def test_parquet_json_and_datasets_sources_agree(tiny_tokenizer, tmp_path):
    import datasets

    rows = [GOOD, {"prompt": "3+4=", "completion": "7"}]
    renderer = Renderer(tiny_tokenizer, "tiny")
    reference, _ = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), renderer, 512)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "array.jsonl").write_text(json.dumps(rows, indent=2))  # an array under a JSON Lines name, as datasets reads it
    for source in (tmp_path / "d.json", tmp_path / "array.jsonl"):
        assert load_examples(source, renderer, 512)[0] == reference
    messages_only = datasets.Dataset.from_list([GOOD, GOOD])
    messages_only.to_parquet(str(tmp_path / "d.parquet"))
    messages_only.save_to_disk(str(tmp_path / "saved"))
    for source in (tmp_path / "d.parquet", tmp_path / "saved", messages_only):
        assert load_examples(source, renderer, 512)[0] == [reference[0], reference[0]]


BAD_ROWS = {
    "missing messages": ({"conversation": []}, "line 2: missing `messages`"),
    "unknown role": ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "line 2: `messages[0]`: unknown role 'robot'"),
    "ShareGPT's roles": ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
                         "line 2: `conversations[0]`: unknown role 'human' (expected one of system, user, assistant, tool); ShareGPT's 'human' is 'user'"),
    "empty completion": ({"prompt": "1+1=", "completion": "  "}, "line 2: `completion` is empty"),
    "null completion": ({"prompt": "1+1=", "completion": None}, "line 2: `completion` is null"),
    "non-string content": ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}, "line 2: `messages[0]`: `content` must be a string, got int"),
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: `messages` has no assistant turn"),
    "mixed prompt shapes": ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}, "line 2: `prompt` and `completion` must both be"),
    "empty assistant turn": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}, "line 2: `messages[1]`: the assistant turn is empty"),
    # Valid JSON ("\ud800"), but no character: the tokenizer's TypeError came without file or line.
    "two shapes": ({**GOOD, "prompt": "1+1=", "completion": "2"}, "line 2: the row has both `messages` and `completion`: give one shape"),
    "lone surrogate": ({"prompt": "a\ud800b", "completion": "x"}, "line 2: `prompt` holds a lone surrogate escape"),
    "lone surrogate in a turn": ({"messages": [{"role": "user", "content": "\udc80"}, {"role": "assistant", "content": "x"}]},
                                 "line 2: `messages[0].content` holds a lone surrogate escape"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_names_file_and_row(case, tiny_tokenizer, tmp_path):
    row, expected = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row, GOOD])
    with pytest.raises(DataError) as error:
        load_examples(path, Renderer(tiny_tokenizer, "tiny"), 512)
    assert str(error.value).startswith(f"{path}: ")
    assert expected in str(error.value)


def test_rows_are_named_by_their_line_in_the_file(tiny_tokenizer, tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({"prompt": "1+1=", "completion": ""}) + "\n")
    with pytest.raises(DataError, match=r"gaps.jsonl: line 3: `completion` is empty"):  # the blank line 2 counts
        load_examples(path, Renderer(tiny_tokenizer, "tiny"), 512)
    (tmp_path / "rows.json").write_text(json.dumps([GOOD, {"conversation": []}]))
    with pytest.raises(DataError, match=r"rows.json: row 2: missing `messages`"):  # no lines: rows count from 1
        load_examples(tmp_path / "rows.json", Renderer(tiny_tokenizer, "tiny"), 512)


def test_sharegpt_rows_of_from_and_value_are_read_as_trl_reads_them(tiny_tokenizer, tmp_path):
    """TRL renames a message's `from` and `value`, and a `conversations` column, to ChatML's names: so does this (the
    rows were refused as missing `messages`)."""
    renderer = Renderer(tiny_tokenizer, "tiny")
    sharegpt = {"conversations": [{"from": turn["role"], "value": turn["content"]} for turn in GOOD["messages"]]}
    split = {"prompt": [{"from": "user", "value": "3+4="}], "completion": [{"from": "assistant", "value": "7"}]}
    chatml = {"prompt": [{"role": "user", "content": "3+4="}], "completion": [{"role": "assistant", "content": "7"}]}
    assert load_examples(write_jsonl(tmp_path / "s.jsonl", [sharegpt, split]), renderer, 512)[0] == load_examples(write_jsonl(tmp_path / "c.jsonl", [GOOD, chatml]), renderer, 512)[0]


def test_a_parquet_file_may_mix_the_row_shapes_as_jsonl_may(tiny_tokenizer, tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [GOOD, {"prompt": "3+4=", "completion": "7"}]
    renderer = Renderer(tiny_tokenizer, "tiny")
    columns = {key: [row.get(key) for row in rows] for key in ("messages", "prompt", "completion")}  # null where a row lacks it
    pyarrow.parquet.write_table(pyarrow.Table.from_pydict(columns), tmp_path / "mixed.parquet")
    assert load_examples(tmp_path / "mixed.parquet", renderer, 512)[0] == load_examples(write_jsonl(tmp_path / "mixed.jsonl", rows), renderer, 512)[0]


def test_unreadable_files_are_one_error_naming_the_file(tiny_tokenizer, tmp_path):
    renderer = Renderer(tiny_tokenizer, "tiny")
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"prompt": "caf\xe9", "completion": "x"}\n'.encode("latin-1"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "broken.json").write_text('[{"messages": []},\n {')
    (tmp_path / "folder").mkdir()
    (tmp_path / "rows.CSV").write_text("prompt,completion\n1+1=,2\n")  # read as JSON Lines, it was "invalid JSON"
    (tmp_path / "rows.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00")
    for name, message in {
        "rows.CSV": r"rows.CSV: a CSV file is not read; give a .jsonl, .json or .parquet file",
        "rows.jsonl.gz": r"rows.jsonl.gz: a compressed file is not read",
        "latin1.jsonl": r"latin1.jsonl: line 2: not valid UTF-8 \(byte 0xe9 at column 16\)",
        "broken.parquet": r"broken.parquet: cannot be read \(ArrowInvalid: ",
        "broken.json": r"broken.json: line 2: invalid JSON",
        "folder": r"folder: a folder, but not one `datasets.save_to_disk` wrote",
    }.items():
        with pytest.raises(DataError, match=message):
            load_examples(tmp_path / name, renderer, 512)


def test_invalid_json_names_line(tiny_tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl: line 2: invalid JSON"):
        load_examples(path, Renderer(tiny_tokenizer, "tiny"), 512)


def test_example_longer_than_max_length(tiny_tokenizer, tmp_path):
    long_row = {"prompt": "1+" * 200 + "1=", "completion": "201"}
    path = write_jsonl(tmp_path / "long.jsonl", [GOOD, GOOD, long_row])
    with pytest.raises(DataError, match=r"long.jsonl: line 3: \d+ tokens, longer than max_length=64"):
        load_examples(path, Renderer(tiny_tokenizer, "tiny"), 64)


def test_an_example_past_the_positions_the_model_learned_is_refused_naming_its_row(tiny_tokenizer, tmp_path):
    """GPT-2 learned 64 positions here (``n_positions``): a longer row would index past its table in the forward."""
    from transformers import GPT2Config

    from lightning_rl.data.sft import SFTDataModule

    GPT2Config(vocab_size=len(tiny_tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer.save_pretrained(tmp_path / "gpt2")
    long_row = {"prompt": "1+" * 40 + "1=", "completion": "41"}
    data = SFTDataModule(write_jsonl(tmp_path / "long.jsonl", [GOOD, long_row]), max_tokens=256, tokenizer=str(tmp_path / "gpt2"))
    with pytest.raises(DataError, match=r"^.*long.jsonl: line 2: \d+ tokens, longer than the 64 positions the model learned "
                       r"\(its config's n_positions\) \(shorten the row\)$"):
        data.setup("fit")


def test_tokenizer_without_chat_template(tiny_path, tmp_path):
    bare = AutoTokenizer.from_pretrained(tiny_path)
    bare.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(DataError, match="tokenizer bare-tok has no chat template"):
        load_examples(path, Renderer(bare, "bare-tok"), 512)
    # String prompt/completion rows need no template.
    assert load_examples(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "1+1=", "completion": "2"}]), Renderer(bare, "bare-tok"), 512)[0]


@pytest.fixture(scope="module")
def toy_examples(tiny_tokenizer):
    return load_examples(TOY_TRAIN, Renderer(tiny_tokenizer, "tiny"), 512)[0][:300]


@pytest.mark.parametrize("packing", ["tree", "flat", "none"])
def test_rows_respect_the_token_budget_and_cover_every_example(packing, toy_examples):
    batches = plan_batches(toy_examples, range(len(toy_examples)), 400, packing)
    assert sorted(i for b in batches for i in b) == list(range(len(toy_examples)))
    for batch in batches:
        seqs = [toy_examples[i].input_ids for i in batch]
        cost = {"tree": count_unique_tokens(seqs), "flat": sum(map(len, seqs))}.get(packing)
        assert packing == "none" and len(batch) == 1 or cost <= 400
    if packing == "tree":  # the shared system prompt lets a tree row hold far more examples than a flat one
        flat = plan_batches(toy_examples, range(len(toy_examples)), 400, "flat")
        assert len(batches) * 2 < len(flat)


def test_sampler_is_seeded_resumable_and_sharded(toy_examples):
    make = lambda **kw: TokenBudgetBatchSampler(toy_examples, 400, "tree", shuffle=True, seed=3, **kw)  # noqa: E731
    a, b = make(), make()
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    resumed = make()
    resumed.set_epoch(1)
    resumed.skip_batches(1, 2)
    assert list(resumed) == list(a)[2:]
    assert len(resumed) == len(a)
    for world in (2, 3, len(b) + 1):  # no example dropped: a rank one batch short takes an empty one
        ranks = [list(make(rank=r, world_size=world)) for r in range(world)]
        assert {len(batches) for batches in ranks} == {-(-len(b) // world)}
        assert sorted(i for batches in ranks for batch in batches for i in batch) == list(range(len(toy_examples)))
    seeds = [TokenBudgetBatchSampler(toy_examples, 400, "tree", shuffle=True, seed=seed) for seed in (0, 1)]
    seeds[0].set_epoch(1)
    assert list(seeds[0]) != list(seeds[1])  # seed 0's second epoch is not seed 1's first


def test_every_epoch_trains_every_example_once_in_at_most_as_many_rows_as_the_first(toy_examples):
    """Lightning reads the number of rows once per run: an epoch with more would end before its last rows."""
    examples = toy_examples[:12]  # 37 and 42 tokens: rows of 120 hold two or three, depending on the order
    sampler = TokenBudgetBatchSampler(examples, 120, "flat", shuffle=True, seed=3)
    counts = [len(plan_batches(examples, sampler._order(12, epoch), 120, "flat")) for epoch in range(6)]
    assert any(count > counts[0] for count in counts[1:])  # an epoch's own order would pack into more rows
    epochs = []
    for epoch in range(6):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
        assert len(epochs[-1]) <= len(epochs[0]) == counts[0]
        assert sorted(i for row in epochs[-1] for i in row) == list(range(12))
    assert len({tuple(map(tuple, rows)) for rows in epochs}) == 6  # every epoch its own


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def test_a_tools_column_reaches_the_chat_template_as_in_trl(tiny_tokenizer, tmp_path):
    """The functions a conversation may call are rendered where the template puts them (here, a system turn), never
    trained; a JSON string of them is read too; a row that cannot render them is refused naming the column."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    messages = [{"role": "user", "content": "Weather in Paris?"}, call, {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}]  # fmt: skip
    calls_as_string = [messages[0], {**call, "tool_calls": json.dumps(call["tool_calls"])}, *messages[2:]]
    rows = [{"messages": messages, "tools": WEATHER}, {"messages": messages, "tools": json.dumps(WEATHER)}, {"messages": messages},
            {"prompt": messages[:1], "completion": messages[1:], "tools": WEATHER}, {"messages": calls_as_string, "tools": WEATHER}]  # fmt: skip
    (with_tools, as_string, without, split, calls_read), _ = load_examples(write_jsonl(tmp_path / "t.jsonl", rows), Renderer(tiny_tokenizer, "tiny"), 512)
    assert calls_read == with_tools  # tool calls stored as a JSON string are read as such, as `tools` are
    plain = {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4", "tool_calls": ""}]}
    (empty,), _ = load_examples(write_jsonl(tmp_path / "e.jsonl", [plain]), Renderer(tiny_tokenizer, "tiny"), 512)
    plain["messages"][1].pop("tool_calls")  # "" (a table's empty cell) is no calls
    assert empty == load_examples(write_jsonl(tmp_path / "n.jsonl", [plain]), Renderer(tiny_tokenizer, "tiny"), 512)[0][0]
    for bad, why in (("{not json", "is a string but not JSON"), ({"name": "f"}, "must be a list of calls")):
        row = {"messages": [messages[0], {**call, "tool_calls": bad}, *messages[2:]]}
        with pytest.raises(DataError, match=rf"line 1: `messages\[1\]`: `tool_calls` {why}"):
            load_examples(write_jsonl(tmp_path / "b.jsonl", [row]), Renderer(tiny_tokenizer, "tiny"), 512)
    text = tiny_tokenizer.decode(with_tools.input_ids)
    assert "get_weather" in text.split("Weather in Paris?")[0] and "The weather in a city" in text
    assert "The weather in a city" not in tiny_tokenizer.decode(without.input_ids)
    assert as_string == with_tools and split.input_ids == with_tools.input_ids and split.loss_mask == with_tools.loss_mask
    trained = tiny_tokenizer.decode([t for t, m in zip(with_tools.input_ids, with_tools.loss_mask) if m])
    assert "get_weather" in trained and "The weather in a city" not in trained  # the call is trained, the schema is not
    with pytest.raises(DataError, match=r"line 1: `tools` are rendered by the chat template: give the row as `messages`"):
        load_examples(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "1+1=", "completion": "2", "tools": WEATHER}]), Renderer(tiny_tokenizer, "tiny"), 512)


def test_a_conversational_prompt_is_matched_with_its_generation_prompt(tiny_tokenizer, tmp_path):
    """A template that closes a conversation unlike an asked prompt (Phi-3's appends its eos without a generation
    prompt) still splits prompt from completion: the prompt is rendered as asked, as TRL renders it."""
    closing = tiny_tokenizer.chat_template + "{% if not add_generation_prompt %}<|endoftext|>{% endif %}"
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = closing
    row = {"prompt": [{"role": "user", "content": "2+3="}], "completion": [{"role": "assistant", "content": "5"}]}
    (example,), _ = load_examples(write_jsonl(tmp_path / "p.jsonl", [row]), Renderer(tokenizer, "closing"), 512)
    messages = row["prompt"] + row["completion"]
    (same,), _ = load_examples(write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}]), Renderer(tokenizer, "closing"), 512)
    assert example.input_ids == same.input_ids and example.loss_mask == same.loss_mask


def test_a_template_closing_a_conversation_with_its_eos_trains_every_turn_and_one_rewriting_a_turn_is_refused(tiny_tokenizer, tmp_path):
    """Phi-3's template, without generation blocks, appends its eos where a conversation ends: the conversation up to an
    earlier reply then differs from the whole after that reply's end, and every multi-turn row was refused (TRL
    trains them). A template that renders an earlier reply itself otherwise (Qwen3 drops its reasoning) is refused."""
    def renderer(template: str) -> Renderer:
        tokenizer = copy.deepcopy(tiny_tokenizer)
        tokenizer.chat_template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        return Renderer(tokenizer, "closing")
    turns = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
             {"role": "assistant", "content": "4"}]  # fmt: skip
    rows = [{"messages": turns}, {"prompt": turns[:3], "completion": turns[3:]}]
    closing = renderer(tiny_tokenizer.chat_template + "{% if not add_generation_prompt %}{{ eos_token }}{% endif %}")
    (whole, asked), _ = load_examples(write_jsonl(tmp_path / "c.jsonl", rows), closing, 512)
    # Each reply through its end; the last through the closing eos (as TRL trains Phi-3's last reply).
    assert trained_text(tiny_tokenizer, whole) == "2<|im_end|>4<|im_end|>\n<|im_end|>"
    assert trained_text(tiny_tokenizer, asked) == "4<|im_end|>\n<|im_end|>"
    rewriting = renderer(tiny_tokenizer.chat_template.replace("{{ message.content or \'\' }}", "{{ (message.content or \'\') if loop.last else \'...\' }}"))
    with pytest.raises(DataError, match="line 1: .*the chat template renders turn 1 differently once later turns follow"):
        load_examples(write_jsonl(tmp_path / "r.jsonl", rows[:1]), rewriting, 512)


def test_the_held_out_reference_is_the_final_reply_as_trained(tiny_tokenizer, tmp_path):
    """Qwen3's template writes an empty ``<think></think>`` (not special tokens) before every final reply: a greedy
    reply that wrote it never equalled the message's content, and exact match read 0% for a model that had learnt
    every row."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("{{ message.content or \'\' }}", "{{ \'<think></think> \' + (message.content or \'\') }}")
    row = {"messages": [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]}
    (example,), (case,) = load_examples(write_jsonl(tmp_path / "t.jsonl", [row]), Renderer(tokenizer, "thinking"), 512)
    assert trained_text(tokenizer, example) == "<think></think> 19<|im_end|>"
    assert case.reference == "<think></think> 19"  # what the model is trained to write, up to its end of turn
    (plain,), (plain_case,) = load_examples(write_jsonl(tmp_path / "p.jsonl", [row]), Renderer(tiny_tokenizer, "tiny"), 512)
    assert plain_case.reference == "19"


def test_generation_blocks_that_leave_out_the_end_of_turn_are_said_once(tiny_tokenizer, tmp_path, capsys):
    """Every reply then trains without its end, and the model never learns to stop: TRL warns, this said nothing."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("{{ \'<|im_end|>\' }}{% endgeneration %}", "{% endgeneration %}{{ \'<|im_end|>\' }}")
    rows = [json.loads(line) for line in TOY_TRAIN.read_text().splitlines()[:3]]
    examples, _ = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), Renderer(tokenizer, "open"), 512)
    assert all(not trained_text(tokenizer, e).endswith("<|im_end|>") for e in examples)
    assert capsys.readouterr().err.count("note: tokenizer open: the chat template's {% generation %} blocks leave out the end of turn") == 1
    load_examples(write_jsonl(tmp_path / "d.jsonl", rows), Renderer(tiny_tokenizer, "tiny"), 512)  # its blocks hold the end
    assert "leave out the end of turn" not in capsys.readouterr().err


def test_turns_of_text_parts_read_as_their_text_in_every_role(tiny_tokenizer, tmp_path):
    parts = lambda text: [{"type": "text", "text": text[:2]}, {"type": "text", "text": text[2:]}]  # noqa: E731
    as_parts = {"messages": [{"role": m["role"], "content": parts(m["content"])} for m in GOOD["messages"]]}
    (ours, theirs), _ = load_examples(write_jsonl(tmp_path / "p.jsonl", [as_parts, GOOD]), Renderer(tiny_tokenizer, "tiny"), 512)
    assert ours == theirs


def test_a_conversation_of_one_assistant_turn_trains_and_asks_nothing_held_out(tiny_tokenizer, tmp_path):
    row = {"messages": [{"role": "assistant", "content": "5"}]}
    (example,), cases = load_examples(write_jsonl(tmp_path / "a.jsonl", [row]), Renderer(tiny_tokenizer, "tiny"), 512)
    assert any(example.loss_mask) and cases == []


def test_tool_calls_and_tool_schemas_from_parquet_are_those_each_row_gave(tiny_tokenizer, tmp_path):
    """Arrow stores the objects of a column as one struct: a call read back had the other calls' argument names, and
    a tool's schema the other tools' parameters, as null, and the model trained on those nulls."""
    import pyarrow
    import pyarrow.parquet

    def tool(name, parameter):
        schema = {"type": "object", "properties": {parameter: {"type": "integer"}}, "required": [parameter]}
        return {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}

    def row(arguments):
        call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return {"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}],
                "tools": [tool("add", "a"), tool("neg", "x")]}  # fmt: skip

    rows = [row({"city": "Paris"}), row({"city": "Oslo", "days": 3})]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "calls.parquet")
    renderer = Renderer(tiny_tokenizer, "tiny")
    from_parquet, _ = load_examples(tmp_path / "calls.parquet", renderer, 512)
    from_jsonl, _ = load_examples(write_jsonl(tmp_path / "calls.jsonl", rows), renderer, 512)
    text = tiny_tokenizer.decode(from_parquet[0].input_ids)
    assert from_parquet == from_jsonl and "days" not in text and "null" not in text


def test_a_parquet_file_datasets_wrote_with_tools_of_several_shapes_reads_as_its_jsonl(tiny_tokenizer, tmp_path):
    """`datasets` stores a column whose objects differ in shape as JSON text: read with pyarrow alone, each tool's
    schema came back as a string, which the template rendered quoted (or a row was refused as no messages)."""
    import datasets

    def tool(name, properties):
        return [{"type": "function", "function": {"name": name, "description": name, "parameters": {"type": "object", "properties": properties}}}]

    rows = [{**GOOD, "tools": tool("add", {"a": {"type": "integer"}})},
            {**GOOD, "tools": tool("upper", {"s": {"type": "string", "enum": ["x"]}})}]  # fmt: skip
    jsonl = write_jsonl(tmp_path / "t.jsonl", rows)
    datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(tmp_path / "cache")).to_parquet(str(tmp_path / "t.parquet"))
    renderer = Renderer(tiny_tokenizer, "tiny")
    from_parquet, _ = load_examples(tmp_path / "t.parquet", renderer, 512)
    assert from_parquet == load_examples(jsonl, renderer, 512)[0]
    assert '"enum": ["x"]' in tiny_tokenizer.decode(from_parquet[1].input_ids)
    # A column type `datasets` has no feature for (Spark's maps) is read by pyarrow alone, as before.
    import pyarrow
    import pyarrow.parquet

    table = pyarrow.table({"messages": pyarrow.array([GOOD["messages"]]), "meta": pyarrow.array([[("k", 1)]], pyarrow.map_(pyarrow.string(), pyarrow.int64()))})
    pyarrow.parquet.write_table(table, tmp_path / "map.parquet")
    assert load_examples(tmp_path / "map.parquet", renderer, 512)[0] == load_examples(write_jsonl(tmp_path / "m.jsonl", [GOOD]), renderer, 512)[0]


def test_data_files_are_read_by_their_content_whatever_the_case_of_their_suffix_and_from_home(tmp_path, monkeypatch):
    import pyarrow
    import pyarrow.parquet

    from lightning_rl.data.sft import read_rows

    rows = [json.loads(line) for line in TOY_TRAIN.read_text().splitlines()[:3]]
    (tmp_path / "lines.json").write_text("".join(json.dumps(row) + "\n" for row in rows))  # JSON Lines named .json
    (tmp_path / "list.JSON").write_text(json.dumps(rows))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.PARQUET")
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("lines.json", "list.JSON", "rows.PARQUET", "~/lines.json"):
        _, read = read_rows(str(tmp_path / name) if not name.startswith("~") else name)
        assert [row for _, row in read] == rows, name


def test_the_chat_templates_end_of_turn_is_read_from_what_it_writes_after_a_reply(tiny_tokenizer):
    """The special token right after a reply (whitespace between allowed) ends it; a template that closes a reply with
    plain text, or a tokenizer without a template, names none (the generation config and eos then decide alone)."""
    base = copy.deepcopy(tiny_tokenizer)
    base.eos_token = "<|endoftext|>"
    im_end, endoftext = base.convert_tokens_to_ids("<|im_end|>"), base.convert_tokens_to_ids("<|endoftext|>")
    assert template_end_of_turn(base) == im_end
    assert end_of_turn_ids(None, base) == [endoftext, im_end]
    spaced = copy.deepcopy(base)
    spaced.chat_template = base.chat_template.replace("{{ '<|im_end|>' }}", "{{ '  <|im_end|>' }}")
    assert template_end_of_turn(spaced) == im_end
    needs_system = copy.deepcopy(base)  # a template that raises on a conversation without a system message
    needs_system.chat_template = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}" + base.chat_template
    assert template_end_of_turn(needs_system) == im_end
    plain = copy.deepcopy(base)
    plain.chat_template = base.chat_template.replace("{{ '<|im_end|>' }}", "{{ '### done' }}")
    assert "### done" in plain.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tokenize=False)
    assert template_end_of_turn(plain) is None and end_of_turn_ids(None, plain) == [endoftext]
    plain.chat_template = None
    assert template_end_of_turn(plain) is None


def test_a_held_out_prompt_past_the_models_context_is_refused_naming_its_row(tiny_path, tiny_tokenizer, tmp_path):
    """GRPO's held-out evaluation decoded such a prompt past the model's positions and reported a score (0%) for it;
    training prompts as long were refused. Only the cases evaluated are checked."""
    from lightning_rl.modules.evaluation import heldout_cases

    rows = [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},
            {"messages": [{"role": "user", "content": "1+1= " * 40}, {"role": "assistant", "content": "2"}]}]  # fmt: skip
    path = write_jsonl(tmp_path / "heldout.jsonl", rows)
    short = len(heldout_cases(path, tiny_tokenizer, str(tiny_path))[0].prompt_ids)
    assert len(heldout_cases(path, tiny_tokenizer, str(tiny_path), count=1, context=short + 16, max_new_tokens=16)) == 1
    with pytest.raises(DataError, match=rf"heldout.jsonl: line 2: the held-out prompt is \d+ tokens; with eval_max_new_tokens=16 it "
                       rf"does not fit the model's context of {short + 16} tokens"):
        heldout_cases(path, tiny_tokenizer, str(tiny_path), count=2, context=short + 16, max_new_tokens=16)


def test_a_generation_block_that_holds_the_separator_after_the_end_of_turn_does_not_train_it(tiny_tokenizer, tmp_path):
    """TRL's Qwen2.5 training template puts the newline after <|im_end|> inside its {% generation %} block: it was
    trained there, though not with a template without blocks. Each trained run now ends at its end-of-turn token."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}", "{{ '<|im_end|>\\n' }}{% endgeneration %}")
    assert tokenizer.chat_template != tiny_tokenizer.chat_template
    row = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                        {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}  # fmt: skip
    (example,), _ = load_examples(write_jsonl(tmp_path / "m.jsonl", [row]), Renderer(tokenizer, "newline in block"), 512)
    assert trained_text(tokenizer, example) == "2<|im_end|>4<|im_end|>"


def _without_blocks(tiny_tokenizer, template: str) -> Renderer:
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return Renderer(tokenizer, "changed")


def test_a_reasoning_generation_prompt_trains_each_reply_from_where_the_renderings_part(tiny_tokenizer, tmp_path):
    """DeepSeek-R1's and Nemotron's templates open the generation prompt with `<think>`, which a finished turn does not
    render: one-turn rows were refused as rendering "differently once later turns follow". TRL trains the reply from
    where the prompt as asked and the finished turn part; so does this, once the conversation before it agrees."""
    asked = "{{ '<|im_start|>assistant\\n' }}{% endif %}"
    assert asked in tiny_tokenizer.chat_template
    thinking = _without_blocks(tiny_tokenizer, tiny_tokenizer.chat_template.replace(asked, "{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"))
    turns = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
             {"role": "assistant", "content": "4"}]  # fmt: skip
    rows = [{"messages": turns[:2]}, {"prompt": turns[:1], "completion": turns[1:2]}, {"messages": turns}]
    (one, split, two), _ = load_examples(write_jsonl(tmp_path / "t.jsonl", rows), thinking, 512)
    assert trained_text(tiny_tokenizer, one) == trained_text(tiny_tokenizer, split) == "2<|im_end|>"
    assert one.input_ids == split.input_ids and trained_text(tiny_tokenizer, two) == "2<|im_end|>4<|im_end|>"
    # The completion's every token (assistant_only_loss: false) likewise: from where they part, the header not trained.
    thinking.assistant_only_loss = False
    (whole,), _ = load_examples(write_jsonl(tmp_path / "w.jsonl", rows[1:2]), thinking, 512)
    assert whole.input_ids == split.input_ids and trained_text(tiny_tokenizer, whole) == "2<|im_end|>\n"  # TRL's tokens


def test_a_reply_ended_by_the_next_turns_opening_end_token_trains_it(tiny_tokenizer, tmp_path, capsys):
    """GLM-4.5's template ends no reply itself: the next turn opens with `<|user|>`, one of the model's end tokens. The
    reply is trained through it, the conversation's last one too, where the template renders nothing after it (it was
    trained without an end, and a one-turn dataset taught no reply to stop): TRL's training template ends it so."""
    template = tiny_tokenizer.chat_template.replace("{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}", "{% endgeneration %}")
    template = template.replace("{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
                                "{{ '<|im_end|>' + message.role + '\\n' + message.content }}")  # fmt: skip
    glm = _without_blocks(tiny_tokenizer, template)
    turns = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
             {"role": "assistant", "content": "4"}]  # fmt: skip
    rows = [{"messages": turns}, {"messages": turns[:2]}, {"prompt": turns[:1], "completion": turns[1:2]}]
    (two, one, split), _ = load_examples(write_jsonl(tmp_path / "g.jsonl", rows), glm, 512)
    assert trained_text(tiny_tokenizer, two) == "2<|im_end|>4<|im_end|>" and trained_text(tiny_tokenizer, one) == "2<|im_end|>"
    assert one.input_ids == split.input_ids and one.input_ids[-1] == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "renders no end-of-turn token" not in capsys.readouterr().err


def test_files_as_editors_and_tools_save_them_are_read_or_refused_in_one_line(tmp_path, monkeypatch):
    """A byte-order mark (Notepad, PowerShell) was invalid JSON; Parquet under another name was read as JSON Lines; a
    saved dataset of no rows failed inside `datasets`; a pipe was read twice (no rows, or a hang on a FIFO); and without
    the `data` extra a Parquet file ended in a traceback."""
    import os

    import datasets

    from lightning_rl.data.sft import read_rows

    rows = [json.loads(line) for line in TOY_TRAIN.read_text().splitlines()[:3]]
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + TOY_TRAIN.read_bytes())
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.pq"))
    assert [row for _, row in read_rows(str(tmp_path / "bom.jsonl"))[1][:3]] == rows
    assert [row for _, row in read_rows(str(tmp_path / "bom.json"))[1]] == rows
    assert [row for _, row in read_rows(str(tmp_path / "rows.pq"))[1]] == rows
    datasets.Dataset.from_list(rows).select([]).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(DataError, match=r"empty: no rows$"):
        load_examples(str(tmp_path / "empty"), None, 512)
    with pytest.raises(DataError, match=rf"^data.val_data: {tmp_path / 'empty'}: no rows$"):  # the key it was given as (one file may be two)
        load_examples(str(tmp_path / "empty"), None, 512, key="data.val_data")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DataError, match=r"fifo: not a regular file \(a pipe or a device, which can be read only once\)"):
        read_rows(str(tmp_path / "fifo"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as without the `data` extra
    with pytest.raises(DataError, match=r"rows.pq: reading it needs the datasets package: pip install 'lightning-rl\[data\]'$"):
        read_rows(str(tmp_path / "rows.pq"))


def test_a_dataset_of_splits_is_refused_naming_the_split_to_give(tmp_path):
    """A DatasetDict of one split was said to be "of several splits"; the line now names a split to give."""
    import datasets

    from lightning_rl.data.sft import SFTDataModule

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD])})
    with pytest.raises(DataError, match=re.escape("train_data: a DatasetDict of splits (train), not one split: give one of them, e.g. dataset['train']")):
        SFTDataModule(splits)
    frame = datasets.Dataset.from_list([GOOD]).to_pandas()  # iterated, a DataFrame gives its column names, not rows
    with pytest.raises(DataError, match=re.escape("train_data: a pandas DataFrame: give datasets.Dataset.from_pandas(frame), or frame.to_dict('records')")):
        SFTDataModule(frame)
    splits.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=re.escape(f"a dataset of splits (train), not one split; give one split's folder ({tmp_path / 'saved' / 'train'})")):
        SFTDataModule(str(tmp_path / "saved"))
    # The split each key means: the first in the alphabet (test) was offered as the training data.
    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD]), "test": datasets.Dataset.from_list([GOOD])}).save_to_disk(str(both))
    for key, split in (("train_data", "train"), ("val_data", "test")):
        with pytest.raises(DataError, match=re.escape(f"{key}: {both}: a dataset of splits (test, train), not one split; give one split's folder ({both / split})")):
            SFTDataModule(**{"train_data": str(both) if key == "train_data" else str(tmp_path / "saved" / "train"), key: str(both)})


def test_an_epoch_of_fewer_rows_splits_its_fullest_rows_first_in_their_place():
    """The first of the fullest rows is split in halves where it stood, until there are as many rows as asked."""
    from lightning_rl.data.sft import _split_to

    rows = [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert _split_to(rows, 5) == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert _split_to(rows, 6) == [[0], [1], [2, 3], [4, 5], [6, 7], [8]]
    assert _split_to([[0, 1, 2], [3]], 3) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="2 rows of one example each cannot make 3"):
        _split_to([[0], [1]], 3)


def test_a_bad_row_of_a_dataset_given_from_python_names_the_key_it_was_given_as(tmp_path):
    """A Dataset has no path that says which it is: its rows were named 'Dataset: row N', train and held-out alike."""
    import datasets

    from lightning_rl.data.sft import SFTDataModule

    long_row = {"messages": [SYSTEM, {"role": "user", "content": "1+" * 200 + "1="}, {"role": "assistant", "content": "201"}]}
    data = SFTDataModule(write_jsonl(tmp_path / "train.jsonl", [GOOD]), datasets.Dataset.from_list([GOOD, long_row]), max_tokens=128)
    with pytest.raises(DataError, match=r"^data.val_data \(Dataset\): row 2: \d+ tokens, longer than"):
        data.setup("fit")


@pytest.mark.parametrize("every, batches, accumulate, across, most, inside", [
    (3, 56, 2, False, None, 3), (6, 12, 2, False, None, None), (60, 56, 3, True, None, 60), (60, 12, 3, True, None, None),
    (7, 5, 2, True, None, 21),  # batches 7 and 14 end steps (2 and 4 of an epoch), 21 is an epoch's first
    (7, 5, 2, True, 20, None),  # ... and a run of 20 batches never gets there
])  # fmt: skip
def test_a_validation_inside_an_optimizer_step_is_found_where_lightning_puts_it(every, batches, accumulate, across, most, inside):
    from lightning_rl.data.sft import _inside_a_step

    assert _inside_a_step(every, batches, accumulate, across, most) == inside


def test_a_runs_batches_count_each_epochs_shorter_last_step():
    """max_steps=12 over epochs of 5 batches at accumulation 2 (steps of 2, 2, 1) is 20 batches, not 24: batch 21's
    mid-step validation never comes."""
    from types import SimpleNamespace

    from lightning_rl.data.sft import _inside_a_step, _run_batches

    run = SimpleNamespace(accumulate_grad_batches=2, max_steps=12, max_epochs=-1)
    assert _run_batches(run, 5) == 20 and _inside_a_step(7, 5, 2, True, _run_batches(run, 5)) is None
    assert _run_batches(SimpleNamespace(accumulate_grad_batches=2, max_steps=13, max_epochs=None), 5) == 22
    assert _run_batches(SimpleNamespace(accumulate_grad_batches=2, max_steps=-1, max_epochs=3), 5) == 15
    assert _run_batches(SimpleNamespace(accumulate_grad_batches=2, max_steps=-1, max_epochs=-1), 5) is None


def test_plain_text_rows_are_tokenized_and_trained_as_trl_trains_them(tiny_path, tiny_tokenizer, tmp_path):
    """TRL's language-modelling rows (``{"text": ...}``): the text tokenized with its special tokens, the end token
    appended unless it ends with it, every token a label. They were refused as rows missing `messages`."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM

    rows = [{"text": "12+7=19"}, {"text": "reverse 1 2: 2 1<|im_end|>"}, {"text": "<|im_start|>user\nhi"}]
    examples, cases = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), Renderer(tiny_tokenizer, "tiny"), 512)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True)
    trainer = trl.SFTTrainer(AutoModelForCausalLM.from_pretrained(tiny_path), args=args, processing_class=tiny_tokenizer,
                             train_dataset=datasets.Dataset.from_list(rows))
    for example, theirs in zip(examples, trainer.train_dataset, strict=True):
        assert example.input_ids == theirs["input_ids"] and "completion_mask" not in theirs  # TRL: every token a label
        assert example.loss_mask == [False] + [True] * (len(example.input_ids) - 1)  # the first has nothing before it
    assert cases == []  # nothing asked: no held-out reply to decode
    bad = {"null": ({"text": None}, "`text` is null"), "empty": ({"text": " "}, "`text` holds only whitespace"),
           "a list": ({"text": ["a"]}, "`text` must be a string, got list"),
           "tools": ({"text": "a", "tools": WEATHER}, "`tools` are rendered by the chat template"),
           "a stray prompt": ({"text": "a", "prompt": "b"}, "the row has `text` and `prompt` but no `completion`: give one shape"),
           "images": ({"text": "a", "images": ["x.png"]}, "a plain `text` row cannot hold images: they go in a conversation's user turn")}
    for row, message in bad.values():
        with pytest.raises(DataError, match=rf"line 1: {re.escape(message)}"):
            load_examples(write_jsonl(tmp_path / "b.jsonl", [row]), Renderer(tiny_tokenizer, "tiny"), 512)


def test_whole_row_training_is_trls_default_for_conversations_and_a_choice_for_completions(tiny_path, tiny_tokenizer, tmp_path):
    """``data.assistant_only_loss: false`` trains every token of a `messages` row, as TRL does by default (there was no
    way to); ``completion_only_loss: false`` the prompt of a `prompt`/`completion` row too. The tokens are TRL's."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM

    from lightning_rl.data.sft import SFTDataModule

    conversation = {"messages": [SYSTEM, {"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]}
    completion = {"prompt": "12+7=", "completion": "19"}
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    for row, flag in ((conversation, "assistant_only_loss"), (completion, "completion_only_loss")):
        data = SFTDataModule(write_jsonl(tmp_path / f"{flag}.jsonl", [row]), tokenizer=str(tiny_path), **{flag: False})
        data.setup("fit")
        [example] = data.train_examples
        args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True, **{flag: False})
        [theirs] = trl.SFTTrainer(model, args=args, processing_class=tiny_tokenizer, train_dataset=datasets.Dataset.from_list([row])).train_dataset
        assert example.input_ids == theirs["input_ids"]
        assert example.loss_mask == [False] + [True] * (len(example.input_ids) - 1)  # TRL: every token a label
        kept, _ = load_examples(tmp_path / f"{flag}.jsonl", Renderer(tiny_tokenizer, "tiny"), 512)  # by default, the reply
        assert kept[0].input_ids == example.input_ids and sum(kept[0].loss_mask) < sum(example.loss_mask)


def test_a_tokenizer_without_an_eos_token_trains_text_without_one_and_says_so_once(tiny_path, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer.eos_token = None
    examples, _ = load_examples(write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "abd"}]), Renderer(tokenizer, "tiny"), 512)
    assert [e.input_ids for e in examples] == [tokenizer("abc")["input_ids"], tokenizer("abd")["input_ids"]]
    assert capsys.readouterr().err.count("note: tokenizer tiny has no eos_token") == 1


@pytest.mark.parametrize("assistant_only, completion_only", [(True, False), (False, True), (False, False), (True, True)])
def test_a_conversational_completion_is_masked_as_trl_masks_it_under_both_flags(tiny_path, tiny_tokenizer, tmp_path, assistant_only, completion_only):
    """TRL trains a token where every mask it applies keeps it: the assistant turns' and the completion's. Under
    (true, false) the whole row was trained, system and user turns included; under (false, true) the completion's
    assistant turns alone, its tool reply left out."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    row = {"prompt": [SYSTEM, {"role": "user", "content": "Weather in Paris?"}],
           "completion": [call, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    renderer = Renderer(tiny_tokenizer, "tiny", assistant_only_loss=assistant_only, completion_only_loss=completion_only)
    [example], _ = load_examples(write_jsonl(tmp_path / "d.jsonl", [row]), renderer, 512)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True,
                         assistant_only_loss=assistant_only, completion_only_loss=completion_only)
    [theirs] = trl.SFTTrainer(AutoModelForCausalLM.from_pretrained(tiny_path), args=args, processing_class=tiny_tokenizer,
                              train_dataset=datasets.Dataset.from_list([row])).train_dataset
    assert example.input_ids == theirs["input_ids"]
    assert example.loss_mask[1:] == [label != -100 for label in theirs["labels"]][1:]  # the first is no label on either side


def test_a_template_that_drops_tool_calls_or_results_is_refused_naming_the_turn(tiny_tokenizer, tmp_path):
    """Phi-3's template renders neither an assistant turn's tool calls nor a tool's result: the row trained an empty
    reply where the model called a tool, and an answer without the result it read (TRL trains it so, silently)."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    plain = ("{% for m in messages %}{% if m.role != 'tool' or keep_tools %}<|im_start|>{{ m.role }}\n{{ m.content }}"
             "{% for c in m.tool_calls or [] %}{% if keep_calls %}<tool_call>{{ c.function.name }}</tool_call>{% endif %}{% endfor %}"
             "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    turns = [{"role": "user", "content": "Weather in Paris?"}, call, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    rows = [{"messages": turns}, {"prompt": turns[:1], "completion": turns[1:]}]
    for keep, where, what in ((dict(keep_calls=False, keep_tools=True), ["messages[1]", "completion[0]"], "tool call 'get_weather'"),
                              (dict(keep_calls=True, keep_tools=False), ["messages[2]", "completion[1]"], "tool result")):  # fmt: skip
        tokenizer.chat_template = plain.replace("keep_calls", str(keep["keep_calls"])).replace("keep_tools", str(keep["keep_tools"]))
        for row, turn in zip(rows, where):
            with pytest.raises(DataError, match=rf"t.jsonl: line 1: `{re.escape(turn)}`: tokenizer plain's chat template does not render (the turn's|this) {what}"):
                load_examples(write_jsonl(tmp_path / "t.jsonl", [row]), Renderer(tokenizer, "plain"), 512)
    tokenizer.chat_template = plain.replace("keep_calls", "True").replace("keep_tools", "True")
    examples, _ = load_examples(write_jsonl(tmp_path / "t.jsonl", rows), Renderer(tokenizer, "plain"), 512)
    assert len(examples) == 2
    # A result the template escapes (Llama 3's `tojson`) is rendered all the same.
    tokenizer.chat_template = tokenizer.chat_template.replace("{{ m.content }}", "{{ m.content | tojson if m.role == 'tool' else m.content }}")
    escaped = [{**row, **{key: [{**m, "content": '{"sky": "sunny"}\nsure'} if m["role"] == "tool" else m for m in row[key]]
                          for key in ("messages", "completion") if key in row}} for row in rows]  # fmt: skip
    examples, _ = load_examples(write_jsonl(tmp_path / "t.jsonl", escaped), Renderer(tokenizer, "plain"), 512)
    assert len(examples) == 2 and '\\"sky\\"' in tokenizer.decode(examples[0].input_ids)


def test_a_reply_of_weight_zero_is_not_trained_with_or_without_generation_blocks(tiny_tokenizer, tmp_path):
    """OpenAI's fine-tuning rows mark a reply not to learn with `weight: 0`; it was passed through and trained."""
    row = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "3", "weight": 0},
                        {"role": "user", "content": "again"}, {"role": "assistant", "content": "2", "weight": 1}]}  # fmt: skip
    for renderer in (Renderer(tiny_tokenizer, "tiny"), _without_blocks(tiny_tokenizer, tiny_tokenizer.chat_template)):
        (example,), _ = load_examples(write_jsonl(tmp_path / "w.jsonl", [row]), renderer, 512)
        assert trained_text(renderer.tokenizer, example) == "2<|im_end|>", renderer.name
    completion = {"prompt": row["messages"][:1], "completion": row["messages"][1:]}
    (example,), _ = load_examples(write_jsonl(tmp_path / "c.jsonl", [completion]), Renderer(tiny_tokenizer, "tiny"), 512)
    assert trained_text(tiny_tokenizer, example) == "2<|im_end|>"
    bad = {"messages": [{"role": "user", "content": "1+1=", "weight": 0}, {"role": "assistant", "content": "2"}]}
    with pytest.raises(DataError, match=r"line 1: .*`messages\[0\]`: `weight` is an assistant turn's 0 \(not trained\) or 1 \(trained\), got 0 on a user turn"):
        load_examples(write_jsonl(tmp_path / "b.jsonl", [bad]), Renderer(tiny_tokenizer, "tiny"), 512)
    with pytest.raises(DataError, match=r"line 1: .*`messages\[1\]`: `weight: 0` leaves a reply out of the loss, which data.assistant_only_loss: false"):
        load_examples(write_jsonl(tmp_path / "w.jsonl", [row]), Renderer(tiny_tokenizer, "tiny", assistant_only_loss=False), 512)
    # A table fills the turns without a weight with null (Parquet, save_to_disk): no weight, as in the JSONL row.
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([row]).to_parquet(tmp_path / "w.parquet")
    (example,), (case,) = load_examples(str(tmp_path / "w.parquet"), Renderer(tiny_tokenizer, "tiny"), 512)
    assert trained_text(tiny_tokenizer, example) == "2<|im_end|>" and case.reference == "2"
    # A last reply not to learn is no held-out reference.
    last_unweighted = {"messages": [row["messages"][0], {"role": "assistant", "content": "2"}, row["messages"][2],
                                    {"role": "assistant", "content": "3", "weight": 0}]}  # fmt: skip
    _, cases = load_examples(write_jsonl(tmp_path / "l.jsonl", [last_unweighted, GOOD]), Renderer(tiny_tokenizer, "tiny"), 512)
    assert len(cases) == 1
