"""``jaxrl-llm generate`` on a tiny local checkpoint with a tiny word-level tokenizer."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl_llm.cli import main
from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import SamplingOptions, generate
from jaxrl_llm.sampling.cli import generate_main
from jaxrl_llm.sampling.engine import EngineSettings, Request, generate_requests
from tests.models.hf_utils import build_checkpoint

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "user:", "assistant:"]
WORDS = [f"w{i}" for i in range(128 - len(SPECIAL))]
TEMPLATE = (
    "<s>{% for m in messages %} user: {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_chat"))
    build_checkpoint("llama", path, seed=5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _blocks(text):
    """``{header: completion}`` from the CLI's output (a header line, then the completion)."""
    lines = text.splitlines()
    return {lines[i]: lines[i + 1] for i in range(0, len(lines), 2)}


def test_generate_main_prints_greedy_completions(model_dir, capsys):
    prompts = ["w3 w17 w5", "w40"]
    argv = [model_dir, *prompts, "--max-new-tokens", "6", "--temperature", "0"]
    assert generate_main(argv) == 0
    printed = _blocks(capsys.readouterr().out)
    assert list(printed) == ["[prompt 0] w3 w17 w5", "[prompt 1] w40"]

    # The same completions by hand: chat template -> ids -> generate -> decode.
    config, params = load_pretrained(model_dir, dtype=jnp.float32)
    template_ids = {"<s>": 1, "user:": 4, "assistant:": 5}
    rows = [
        [template_ids["<s>"], template_ids["user:"]]
        + [int(w[1:]) + len(SPECIAL) for w in prompt.split()]
        + [template_ids["assistant:"]]
        for prompt in prompts
    ]
    width = max(map(len, rows))
    tokens = np.array([[0] * (width - len(r)) + r for r in rows], np.int32)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], bool)
    out = generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=6,
        sampling=SamplingOptions(eos_ids=(2,), pad_id=0, temperature=0.0),
    )
    vocab = SPECIAL + WORDS
    for row, header in enumerate(printed):
        ids = np.asarray(out.tokens[row])[np.asarray(out.mask[row])]
        # skip_special_tokens drops the registered specials (pad, bos, eos, unk) only.
        want = " ".join(vocab[i] for i in ids if i > 3)
        assert printed[header] == want
        assert want, "a completion of only special tokens would make this test vacuous"
    # The prompts may follow the options.
    assert generate_main([model_dir, "--max-new-tokens", "6", "--temperature", "0", *prompts]) == 0
    assert _blocks(capsys.readouterr().out) == printed


def test_generate_subcommand_samples_groups(model_dir, capsys):
    argv = ["generate", model_dir, "w9 w9", "--max-new-tokens", "5", "--num-samples", "3"]
    assert main(argv + ["--temperature", "1.0", "--top-p", "0.95", "--seed", "1"]) == 0
    printed = _blocks(capsys.readouterr().out)
    assert list(printed) == [f"[prompt 0, sample {i}] w9 w9" for i in range(3)]
    assert len(set(printed.values())) > 1, "independent samples should differ"


def test_generate_main_errors(tmp_path, capsys):
    assert generate_main([str(tmp_path / "missing"), "hi"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate_main([str(tmp_path)])  # no prompt


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_generate_jsonl_batch_with_refills(model_dir, tmp_path, capsys):
    rows = [
        {"prompt": "w3 w17 w5", "id": "a"},
        {"messages": [{"role": "user", "content": "w40"}], "max_new_tokens": 2},
        {"prompt": "w9", "max_new_tokens": 5},
    ]
    prompts = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    argv = [model_dir, "--prompts", prompts, "--out", str(out), "--max-new-tokens", "6"]
    argv += ["--num-samples", "2", "--slots", "2", "--temperature", "0", "--no-progress"]
    assert generate_main(argv) == 0
    assert "6 requests" in capsys.readouterr().err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in lines] == [(i, g) for i in range(3) for g in (0, 1)]
    assert lines[0]["id"] == "a" and "id" not in lines[2]

    # The same requests through the engine by hand (chat template applied to every prompt).
    config, params = load_pretrained(model_dir, dtype=jnp.float32)
    ids = {"<s>": 1, "user:": 4, "assistant:": 5}
    vocab = SPECIAL + WORDS
    for n, line in enumerate(lines):
        index = n // 2
        text = rows[index].get("prompt") or rows[index]["messages"][0]["content"]
        prompt = [ids["<s>"], ids["user:"]] + [vocab.index(w) for w in text.split()]
        prompt.append(ids["assistant:"])
        budget = rows[index].get("max_new_tokens", 6)
        (want,), _ = generate_requests(
            params,
            config,
            [Request(prompt, budget)],
            settings=EngineSettings(slots=1),
            max_new_tokens=budget,
            sampling=SamplingOptions(eos_ids=(2,), pad_id=0, temperature=0.0),
        )
        assert line["tokens"] == want.tokens.tolist()
        np.testing.assert_allclose(line["logprobs"], want.logprobs, atol=1e-5)
        assert line["finish_reason"] == want.finish_reason
        assert line["num_tokens"] == len(want.tokens) <= budget
        assert line["text"] == " ".join(vocab[i] for i in want.tokens if i > 3)
    assert lines[0]["tokens"] == lines[1]["tokens"]  # greedy: both samples alike
    assert {len(r["tokens"]) for r in lines[2:4]} <= {1, 2}


def test_generate_jsonl_static_engine_and_sampling(model_dir, tmp_path, capsys):
    prompts = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "w9 w9"}, {"prompt": "w7"}])
    outs = []
    paged = ["--kv-block-size", "4", "--kv-blocks", "7"]  # a row: up to 3 blocks
    for n, (engine, slots, extra) in enumerate(
        (("continuous", "3", []), ("static", "2", []), ("continuous", "3", paged))
    ):
        out = tmp_path / f"{n}.jsonl"
        argv = [model_dir, "--prompts", prompts, "--out", str(out), "--num-samples", "3"]
        argv += ["--max-new-tokens", "5", "--engine", engine, "--slots", slots, "--seed", "4"]
        argv += ["--temperature", "1.5", *extra]
        assert generate_main(argv + ["--no-progress"]) == 0
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert "paged KV cache: peak 7 blocks" in capsys.readouterr().err
    # Per-request sampling streams: the same tokens whatever the engine, slot count and cache
    # (the paged one preempting).
    for other in outs[1:]:
        assert [r["tokens"] for r in outs[0]] == [r["tokens"] for r in other]
    assert len({tuple(r["tokens"]) for r in outs[0][:3]}) > 1, "samples should differ"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"prompt": "w1"}\n{"prompt": 3}\n', r"in.jsonl:2: 'prompt' must be a string"),
        ('{"prompt": "w1", "temperature": 0}\n', r"unknown keys \['temperature'\]"),
        ('{"prompt": "w1", "messages": []}\n', "exactly one of"),
        ("not json\n", "in.jsonl:1: invalid JSON"),
        ('{"prompt": "w1", "max_new_tokens": 0}\n', "'max_new_tokens' must be a positive int"),
        ('{"messages": [{"content": "w1"}]}\n', "'messages' must be"),
        ("\n", "holds no record"),
    ],
)
def test_generate_jsonl_errors(model_dir, tmp_path, capsys, content, match):
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    assert generate_main([model_dir, "--prompts", str(path), "--no-progress"]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_generate_argument_errors(model_dir, tmp_path, capsys):
    assert generate_main([model_dir, "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "is not a file" in capsys.readouterr().err
    prompts = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "w1"}])
    with pytest.raises(SystemExit):
        generate_main([model_dir, "w1", "--prompts", prompts])  # both ways at once


def test_generate_stop_text_ends_the_completion(model_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "w3 w17 w5"}])
    base = [model_dir, "--prompts", prompts, "--max-new-tokens", "8", "--temperature", "0"]
    base += ["--no-progress"]
    free, stopped = tmp_path / "free.jsonl", tmp_path / "stopped.jsonl"
    assert generate_main(base + ["--out", str(free)]) == 0
    (line,) = [json.loads(x) for x in free.read_text().splitlines()]
    words = line["text"].split()
    assert len(words) >= 3, "the free-running completion must be long enough to cut"
    cut = words.index(words[-1])  # stop at the first occurrence of the last word
    assert cut < len(words) - 1, "the stop must cut the completion short"
    assert generate_main(base + ["--out", str(stopped), "--stop", words[cut]]) == 0
    (line,) = [json.loads(x) for x in stopped.read_text().splitlines()]
    assert line["text"].split() == words[: cut + 1]
    assert line["finish_reason"] == "stop"


# -- the prompt format a policy was trained with (issue 46) ------------------------------------


def _trained(model_dir, tmp_path, *, chat_template, system_prompt=None):
    """A copy of the checkpoint recording the prompt format a run trained it with."""
    import shutil

    from jaxrl_llm.data.encoding import PromptFormat, write_prompt_format

    path = tmp_path / "policy"
    shutil.copytree(model_dir, path)
    write_prompt_format(
        path, PromptFormat(chat_template=chat_template, system_prompt=system_prompt)
    )
    return str(path)


def _tokens(capsys, argv, out):
    assert generate_main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    return [json.loads(x)["tokens"] for x in out.read_text().splitlines()], notes


def test_generate_prompts_a_policy_as_it_was_trained(model_dir, tmp_path, capsys):
    """A policy trained on raw prompts is prompted raw although its tokenizer has a chat
    template; ``--chat-template`` still applies it, with a one-line note of the mismatch."""
    policy = _trained(model_dir, tmp_path, chat_template=False)
    argv = [policy, "w3 w17 w5", "w40", "--max-new-tokens", "6", "--temperature", "0"]
    default, notes = _tokens(capsys, argv, tmp_path / "default.jsonl")
    assert notes == []
    raw, notes = _tokens(capsys, [*argv, "--no-chat-template"], tmp_path / "raw.jsonl")
    assert raw == default and notes == []
    chat, notes = _tokens(capsys, [*argv, "--chat-template"], tmp_path / "chat.jsonl")
    assert chat != raw, "the chat template must change the completions (else this is vacuous)"
    assert len(notes) == 1 and "trained without its chat template" in notes[0], notes
    # The same checkpoint without the record: the tokenizer's template, as before.
    assert _tokens(capsys, [model_dir, *argv[1:]], tmp_path / "plain.jsonl") == (chat, [])


def test_generate_applies_the_chat_template_and_system_prompt_it_was_trained_with(
    model_dir, tmp_path, capsys
):
    policy = _trained(model_dir, tmp_path, chat_template=True, system_prompt="w7 w8")
    argv = [policy, "w3 w17 w5", "--max-new-tokens", "6", "--temperature", "0"]
    prompts = _write_jsonl(
        tmp_path / "in.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "w7 w8"},
                    {"role": "user", "content": "w3 w17 w5"},
                ]
            }
        ],
    )
    by_hand = [model_dir, "--prompts", prompts, "--max-new-tokens", "6", "--temperature", "0"]
    trained, notes = _tokens(capsys, argv, tmp_path / "trained.jsonl")
    assert notes == []
    assert trained == _tokens(capsys, [*by_hand, "--no-progress"], tmp_path / "hand.jsonl")[0]
    _, notes = _tokens(capsys, [*argv, "--no-chat-template"], tmp_path / "raw.jsonl")
    assert len(notes) == 1 and "trained with its chat template" in notes[0], notes


def test_generate_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for default in ("--temperature TEMPERATURE", "--max-new-tokens"):
        assert default in help_text
    assert re.search(r"--temperature TEMPERATURE .*\(default: 1\.0\)", help_text)
    assert re.search(r"--max-new-tokens MAX_NEW_TOKENS .*\(default: 128\)", help_text)
    assert "(default: as the policy was trained" in help_text  # what the flags override
