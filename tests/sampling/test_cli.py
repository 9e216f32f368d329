"""``jaxrl-llm generate`` on a tiny local checkpoint with a tiny word-level tokenizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl_llm.cli import main
from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import generate
from jaxrl_llm.sampling.cli import generate_main
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
        temperature=0.0,
        eos_ids=(2,),
        pad_id=0,
    )
    vocab = SPECIAL + WORDS
    for row, header in enumerate(printed):
        ids = np.asarray(out.tokens[row])[np.asarray(out.mask[row])]
        # skip_special_tokens drops the registered specials (pad, bos, eos, unk) only.
        want = " ".join(vocab[i] for i in ids if i > 3)
        assert printed[header] == want
        assert want, "a completion of only special tokens would make this test vacuous"


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
