"""The model from Python: greedy tokens on kvsift-demo's built-in prompt equal the demo's."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest

import kvsift

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# apps/demo.cpp's built-in document and question.
DEVIL = os.path.join(ROOT, "apps", "common", "devils_dictionary.txt")
PLANTED = "Editor's note: the lighthouse keeper on Gull Island keeps a grey cat named Marmalade."
QUESTION = ("According to the editor's note in the text above, what is the name of the lighthouse "
            "keeper's cat?")


def builtin_document() -> bytes:
    """apps/demo.cpp builtin_document(), byte for byte."""
    with open(DEVIL, "rb") as f:
        text = f.read()
    text = text[text.index(b"PREFACE"):]
    doc = text[:20000]
    doc = doc[:doc.rindex(b"\n\n")]
    middle = doc.index(b"\n\n", len(doc) // 2)
    return doc[:middle] + b"\n\n" + PLANTED.encode() + doc[middle:]


def demo_binary() -> str:
    for path in (os.environ.get("KVSIFT_DEMO", ""),
                 os.path.join(ROOT, "build", "apps", "kvsift-demo")):
        if path and os.access(path, os.X_OK):
            return path
    pytest.skip("kvsift-demo not built (KVSIFT_DEMO gives its path)")


def test_greedy_tokens_on_the_demo_prompt_equal_kvsift_demos(model, model_path):
    if not os.path.exists(DEVIL):
        pytest.skip(f"no {DEVIL} (the demo's document)")
    run = subprocess.run([demo_binary(), "--model", model_path, "--print-tokens", "--threads", "2"],
                         capture_output=True, text=True, check=True, timeout=900)
    demo_tokens = [int(t) for t in
                   re.search(r"answer token ids:\s*([-\d ]*)", run.stdout).group(1).split()]
    demo_answer = run.stdout.split("\nA: ", 1)[1].split("\n\ncontext tokens:", 1)[0]
    assert demo_tokens, run.stdout

    user = builtin_document().decode("utf-8") + "\n\n" + QUESTION
    calls = []
    tokens = list(model.generate_tokens([{"role": "user", "content": user}], max_new=48,
                                        progress=lambda done, total: calls.append((done, total))))
    assert tokens == demo_tokens
    assert model.detokenize(tokens).decode("utf-8") == demo_answer
    assert "Marmalade" in demo_answer
    total = calls[-1][1]
    assert calls[-1] == (total, total) and total > 4000
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_generate_yields_the_text_of_generate_tokens(model):
    prompt = [("user", "Write one sentence about a lighthouse.")]
    tokens = list(model.generate_tokens(prompt, max_new=24))
    pieces = list(model.generate(prompt, max_new=24))
    assert all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == model.detokenize(tokens).decode("utf-8")
    assert len(tokens) > 3


def test_tokenize_template_prefill_decode_and_stats(model):
    info = model.info
    assert isinstance(info, kvsift.ModelInfo) and info.n_ctx == 8192 and info.n_vocab > 1000
    ids = model.tokenize("Hello, world")
    assert ids.dtype == np.int32 and model.detokenize(ids) == b"Hello, world"
    prompt = model.chat_template([{"role": "user", "content": "Say hi."}])
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    tokens = model.tokenize(prompt, parse_special=True)
    seq = model.create_sequence()
    logits = model.prefill(seq, tokens, all_logits=True)
    assert logits.shape == (len(tokens), info.n_vocab)
    last = model.logits(seq)
    np.testing.assert_array_equal(last, logits[-1])
    fork = model.fork(seq)
    greedy = kvsift.Sampler()
    t = greedy.sample(last)
    assert t == int(np.argmax(last))
    model.decode([seq], [t])
    np.testing.assert_array_equal(model.logits(seq).shape, (info.n_vocab,))
    st = model.stats()
    assert isinstance(st, kvsift.ModelStats) and st.decode_tokens >= 1
    model.free_sequence(fork)
    model.free_sequence(seq)


def test_a_selector_policy_runs_through_the_model(model):
    model.set_selector(selector="locks", budget=0.5)
    try:
        out = list(model.generate_tokens("Name a colour.", max_new=4))
        assert len(out) >= 1
        assert model.stats().summary_bytes_per_page > 0
    finally:
        model.set_selector(selector="dense")


def test_model_refusals_carry_their_status(model):
    seq = model.create_sequence()
    try:
        with pytest.raises(kvsift.InvalidArgumentError) as e:
            model.prefill(seq, [model.info.n_vocab])
        assert e.value.status == kvsift.Status.INVALID_ARGUMENT
        assert str(model.info.n_vocab) in e.value.message
        with pytest.raises(kvsift.InvalidArgumentError):
            model.chat_template([("user", "hi <|im_end|> there")])
        with pytest.raises(kvsift.NotFoundError):
            model.decode([12345], [1])

        def boom(done, total):
            raise RuntimeError("stop")

        with pytest.raises(RuntimeError, match="stop"):
            model.prefill(seq, model.tokenize("a b c"), progress=boom)
    finally:
        model.free_sequence(seq)


def test_quantized_weights_give_logits_close_to_bf16s(model_path):
    # The same prompt through the weights kept in the file's blocks (integer products against
    # 8-bit activations) and through bf16 weights: the logits differ by the two roundings only.
    text = open(DEVIL, encoding="utf-8").read()[:2000]
    logits = {}
    for weights in ("bf16", "quantized"):
        with kvsift.Model(model_path, n_ctx=1024, n_threads=2, weights=weights) as m:
            tokens = m.tokenize(text)[:200]
            seq = m.create_sequence()
            m.prefill(seq, tokens[:-8])
            steps = []
            for t in tokens[-8:]:
                m.decode([seq], [int(t)])
                steps.append(m.logits(seq).copy())
            logits[weights] = np.stack(steps)
    want, got = logits["bf16"], logits["quantized"]
    relative = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    print("quantized vs bf16 weights: relative logit differences", np.round(relative, 4))
    # Measured on SmolLM2's Q4_1 file: 0.005-0.05, and 0.15 at the first step after the prompt.
    assert np.median(relative) < 0.05 and relative.max() < 0.3
    # Not the same numbers: the keyword reached the library.
    assert relative.max() > 1e-4
    same = np.mean(np.argmax(got, axis=1) == np.argmax(want, axis=1))
    assert same >= 6 / 8


def test_unknown_or_conflicting_weights_are_refused(model_path):
    with pytest.raises(kvsift.InvalidArgumentError, match="weights 'q4' is not bf16, f32 or"):
        kvsift.Model(model_path, n_ctx=64, weights="q4")
    with pytest.raises(kvsift.InvalidArgumentError, match="weights_f32"):
        kvsift.Model(model_path, n_ctx=64, weights_f32=True, weights="quantized")
