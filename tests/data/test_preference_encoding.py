"""Tokenised preference data: the padded layout, length limits and truncation, input errors."""

import numpy as np
import pytest

from jaxrl_llm.data import ARITHMETIC_ALPHABET, build_char_tokenizer, encode_pairs, encode_unpaired


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ARITHMETIC_ALPHABET)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_encode_pairs_layout(tokenizer):
    prompts, chosen, rejected = ["1+1=", "12+30="], ["2", "42"], ["13", "4"]
    arrays, truncated = encode_pairs(
        tokenizer, prompts, chosen, rejected, max_prompt_tokens=16, max_completion_tokens=8
    )
    assert truncated == 0
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    # Prompts (the character tokenizer adds no BOS): left-padded to the longest, 6 tokens.
    assert arrays.prompt_tokens.shape == (2, 6) and arrays.prompt_tokens.dtype == np.int32
    np.testing.assert_array_equal(arrays.prompt_tokens[0], [pad] * 2 + _ids(tokenizer, "1+1="))
    np.testing.assert_array_equal(arrays.prompt_mask[0], [0, 0, 1, 1, 1, 1])
    assert arrays.prompt_mask[1].all()
    # Completions: characters + EOS, right-padded to one width shared by chosen and rejected.
    assert arrays.chosen_tokens.shape == arrays.rejected_tokens.shape == (2, 3)
    np.testing.assert_array_equal(arrays.chosen_tokens[0], _ids(tokenizer, "2") + [eos, pad])
    np.testing.assert_array_equal(arrays.chosen_mask[0], [1, 1, 0])
    np.testing.assert_array_equal(arrays.rejected_tokens[0], _ids(tokenizer, "13") + [eos])
    np.testing.assert_array_equal(arrays.rejected_mask[1], [1, 1, 0])
    assert arrays.chosen_mask.dtype == bool
    np.testing.assert_array_equal(arrays.margins, [0.0, 0.0])


def test_too_long_is_an_error_unless_truncation_is_asked_for(tokenizer):
    kwargs = {"max_prompt_tokens": 4, "max_completion_tokens": 3}
    with pytest.raises(ValueError, match=r"prompt of row 1 has 5 tokens, over max_prompt_tokens=4"):
        encode_pairs(tokenizer, ["1=", "12+3="], ["1", "1"], ["2", "2"], **kwargs)
    with pytest.raises(ValueError, match=r"rejected completion of row 0 has 4 tokens with EOS"):
        encode_pairs(tokenizer, ["1="], ["1"], ["123"], **kwargs)

    arrays, truncated = encode_pairs(
        tokenizer, ["1=", "12+3="], ["1", "1"], ["2", "1234"], truncate=True, **kwargs
    )
    assert truncated == 1
    # The prompt keeps its end, the completion its start (its EOS is cut).
    np.testing.assert_array_equal(arrays.prompt_tokens[1], _ids(tokenizer, "2+3="))
    np.testing.assert_array_equal(arrays.rejected_tokens[1], _ids(tokenizer, "123"))
    assert arrays.rejected_mask[1].all()


def test_encode_pairs_input_errors(tokenizer):
    kwargs = {"max_prompt_tokens": 8, "max_completion_tokens": 8}
    with pytest.raises(ValueError, match="same length"):
        encode_pairs(tokenizer, ["1="], ["1", "2"], ["3"], **kwargs)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        encode_pairs(tokenizer, [""], ["1"], ["2"], add_special_tokens=False, **kwargs)
    with pytest.raises(ValueError, match="max_prompt_tokens must be an int >= 1"):
        encode_pairs(tokenizer, ["1="], ["1"], ["2"], max_prompt_tokens=0, max_completion_tokens=4)
    with pytest.raises(ValueError, match=r"margins must have shape \(1,\)"):
        encode_pairs(tokenizer, ["1="], ["1"], ["2"], margins=[1.0, 2.0], **kwargs)


def test_encode_unpaired_layout(tokenizer):
    arrays, truncated = encode_unpaired(
        tokenizer,
        ["1+1=", "9="],
        ["2", "10"],
        [True, False],
        max_prompt_tokens=8,
        max_completion_tokens=4,
    )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert truncated == 0
    np.testing.assert_array_equal(arrays.completion_tokens[0], _ids(tokenizer, "2") + [eos, pad])
    np.testing.assert_array_equal(arrays.completion_mask[1], [1, 1, 1])
    np.testing.assert_array_equal(arrays.labels, [True, False])
    np.testing.assert_array_equal(arrays.prompt_mask.sum(axis=1), [4, 2])
    with pytest.raises(ValueError, match="labels must be booleans"):
        encode_unpaired(tokenizer, ["1="], ["2"], [1], max_prompt_tokens=8, max_completion_tokens=4)
