"""kvsift under transformers (kvsift.transformers): a small random Llama checks the cache and the
attention function against transformers' own SDPA attention; SmolLM2 from the GGUF file checks
greedy tokens on kvsift-demo's prompt (dense: as SDPA's; LOCKS at 5%: the demo's answer).

Needs torch, transformers 5 and gguf, which make test does not install: the check runs where they
are (scripts/gpu_python_check.sh on the GPU machine, or a venv with them).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the transformers check: "
                            "scripts/gpu_python_check.sh, or a venv with torch and transformers)")
transformers = pytest.importorskip("transformers", minversion="5",
                                   reason="transformers 5 is not installed")

import kvsift  # noqa: E402
import kvsift.transformers as kt  # noqa: E402

from test_model import DEVIL, QUESTION, builtin_document  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Llama: 4 query and 2 KV heads of 64 channels."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=200, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    return model


def forward(model, ids, cache):
    with torch.no_grad():
        return model(torch.tensor(ids, device=model.device), past_key_values=cache,
                     use_cache=True).logits


def test_dense_decode_matches_sdpa_and_chunks_read_back(tiny):
    prompt = np.random.default_rng(1).integers(0, 200, size=(2, 70)).tolist()
    tiny.set_attn_implementation("sdpa")
    ref_cache = transformers.DynamicCache(config=tiny.config)
    ref = [forward(tiny, [p[:50] for p in prompt], ref_cache)]
    ref.append(forward(tiny, [p[50:60] for p in prompt], ref_cache))  # a second chunk
    ref += [forward(tiny, [[t] for t in col], ref_cache) for col in list(zip(*prompt))[60:]]

    kt.enable(tiny)
    with kt.KvsiftCache(tiny.config) as cache:
        got = [forward(tiny, [p[:50] for p in prompt], cache)]
        got.append(forward(tiny, [p[50:60] for p in prompt], cache))
        got += [forward(tiny, [[t] for t in col], cache) for col in list(zip(*prompt))[60:]]
        assert cache.get_seq_length() == 70
        assert [cache.kv.sequence_length(s, 1) for s in cache.seq_ids] == [70, 70]
        assert cache.last_stats is not None and cache.last_stats.pairs == 2 * 2
    # The first chunk is SDPA over the same tensors; the second reads the first back from fp16
    # pages; decode steps attend in kvsift over fp16 K/V: close, not equal, to float32 SDPA.
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for g, r in zip(got[1:], ref[1:]):
        torch.testing.assert_close(g, r, rtol=1e-2, atol=2e-3)


def test_generate_greedy_tokens_dense_equal_sdpa(tiny):
    prompt = np.random.default_rng(3).integers(0, 200, size=300).tolist()
    tiny.set_attn_implementation("sdpa")
    ref = greedy(tiny, prompt, transformers.DynamicCache(config=tiny.config), max_new=24)
    kt.enable(tiny)
    with kt.KvsiftCache(tiny.config) as cache:
        got = greedy(tiny, prompt, cache, max_new=24)
        assert cache.get_seq_length() == 300 + 23  # the last token is sampled, not attended
    assert got == ref and len(got) == 24


def test_sparse_selector_reads_fewer_pages(tiny):
    kt.enable(tiny)
    prompt = np.random.default_rng(2).integers(0, 200, size=(1, 600)).tolist()
    with kt.KvsiftCache(tiny.config, selector="locks", budget=0.1) as cache:
        forward(tiny, prompt, cache)
        forward(tiny, [[5]], cache)
        stats = cache.last_stats
    assert stats.pages_stored == 2 * 38  # 601 tokens in 16-token pages, 2 KV heads
    assert 0 < stats.pages_chosen <= 2 * 3  # 10% of 601 tokens: 3 pages per KV head


def test_errors_are_clear(tiny):
    kt.enable(tiny)
    with pytest.raises(kvsift.UnsupportedError, match="past_key_values=KvsiftCache"):
        forward(tiny, [[1, 2, 3]], transformers.DynamicCache(config=tiny.config))
    with kt.KvsiftCache(tiny.config) as cache, pytest.raises(kvsift.UnsupportedError,
                                                            match="padded"):
        with torch.no_grad():
            tiny(torch.tensor([[1, 2, 3], [0, 4, 5]], device=tiny.device),
                 attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]], device=tiny.device),
                 past_key_values=cache, use_cache=True)
    with pytest.raises(kvsift.InvalidArgumentError):  # S4R needs pre-RoPE keys
        kt.KvsiftCache(tiny.config, selector="s4r", budget=0.1)


@pytest.fixture(scope="module")
def smollm(model_path):
    for name in ("gguf", "accelerate"):  # transformers needs both to read a GGUF file
        pytest.importorskip(name, reason=f"{name} is not installed")
    folder, name = os.path.split(model_path)
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=torch.float32)
    return m.to(DEVICE).eval()


def greedy(model, tokens, cache, max_new=48):
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new, do_sample=False, temperature=None,
                             top_p=None, top_k=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def test_smollm_greedy_tokens_dense_equal_sdpa_and_locks_answers(smollm, model):
    if not os.path.exists(DEVIL):
        pytest.skip(f"no {DEVIL} (the demo's document)")
    user = builtin_document().decode("utf-8") + "\n\n" + QUESTION
    tokens = model.prompt_tokens([{"role": "user", "content": user}]).tolist()

    def answer(ids):
        ids = ids[:next((i for i, t in enumerate(ids) if model.is_end(t)), len(ids))]
        return ids, model.detokenize(ids).decode("utf-8")

    smollm.set_attn_implementation("sdpa")
    ref, ref_text = answer(greedy(smollm, tokens, transformers.DynamicCache(config=smollm.config)))
    kt.enable(smollm)
    with kt.KvsiftCache(smollm.config) as cache:
        dense, dense_text = answer(greedy(smollm, tokens, cache))
    with kt.KvsiftCache(smollm.config, selector="locks", budget=0.05) as cache:
        locks, locks_text = answer(greedy(smollm, tokens, cache))
        stats = cache.last_stats
    print(f"\nprompt: {len(tokens)} tokens on {DEVICE}\nsdpa:         {ref_text!r}\n"
          f"kvsift dense: {dense_text!r}\nkvsift locks 5%: {locks_text!r} "
          f"({stats.pages_chosen} of {stats.pages_stored} pages in the last step's last layer)\n"
          f"dense tokens equal sdpa's: {dense == ref} ({len(dense)} tokens)")
    assert dense == ref
    assert "Marmalade" in ref_text
    assert "Marmalade" in locks_text
    assert stats.pages_chosen < stats.pages_stored / 10


def test_the_readme_example_runs(model_path, capsys):
    for name in ("gguf", "accelerate"):
        pytest.importorskip(name, reason=f"{name} is not installed")
    from test_readme import python_blocks

    code = next(b for b in python_blocks() if "kvsift.transformers" in b)
    exec(compile(code, "README.md", "exec"), {"path": model_path})
    printed = capsys.readouterr().out
    assert "lighthouse" in printed.lower() and "SelectionStats(" in printed
