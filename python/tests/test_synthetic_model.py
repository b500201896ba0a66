"""tools/synthetic_model/make_model.py: small cuts of its shapes load in kvsift's runner, report the
shape's hyperparameters, give finite logits over the shape's vocabulary, and are the same bytes for
the same seed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import kvsift

try:
    import gguf  # noqa: F401  (make_model.py's dependency)
except ImportError:
    pytest.skip("the gguf package is not installed (python/requirements-dev.txt pins it)",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "synthetic_model", "make_model.py")

# (shape, layers written): cuts that keep the test to seconds.
CUTS = [("smollm2-135m", 2), ("llama3.2-1b", 1)]
TYPES = ["bf16", "q8_0", "q4_0"]


@pytest.fixture(scope="module")
def make_model():
    spec = importlib.util.spec_from_file_location("synthetic_make_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def write(make_model, model_path, tmp_path_factory):
    """write(shape, layers, type, seed, again=False) -> path. In this process (the tool reads the
    tokenizer once per process), with SmolLM2's file (KVSIFT_MODEL) as the tokenizer source. A
    file already written for the same arguments is reused unless again=True asks for a second."""
    folder = tmp_path_factory.mktemp("synthetic")
    written: dict[tuple, str] = {}

    def run(shape: str, layers: int, qtype: str, seed: int, again: bool = False,
            context_length: int | None = None) -> str:
        key = (shape, layers, qtype, seed, again, context_length)
        if key not in written:
            out = str(folder / f"{shape}-{layers}-{qtype}-{seed}{'-again' if again else ''}"
                      f"{'' if context_length is None else f'-{context_length}'}.gguf")
            argv = ["--shape", shape, "--type", qtype, "--seed", str(seed), "--layers",
                    str(layers), "--out", out, "--tokenizer-from", model_path]
            if context_length is not None:
                argv += ["--context-length", str(context_length)]
            assert make_model.main(argv) == 0
            written[key] = out
        return written[key]

    yield run
    for path in written.values():  # up to 0.65 GB each: not left for pytest's kept temp folders
        os.remove(path)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape,layers", CUTS)
def test_a_cut_loads_with_the_shapes_hyperparameters_and_finite_logits(make_model, write, shape,
                                                                      layers, qtype):
    path = write(shape, layers, qtype, 7)
    want = make_model.SHAPES[shape]
    with open(path, "rb") as f:
        assert b"meaningless" in f.read(1 << 16)  # general.description says what the file is
    with kvsift.Model(path, n_ctx=256, n_threads=2) as m:
        info = m.info
        assert (info.n_layers, info.n_embd, info.n_heads, info.n_kv_heads, info.head_dim,
                info.n_vocab, info.n_ctx_train) == (
                    layers, want.n_embd, want.n_heads, want.n_kv_heads, want.head_dim,
                    want.n_vocab, want.n_ctx)
        tokens = m.tokenize("The keeper of the lighthouse has a grey cat.")
        assert len(tokens) > 4
        seq = m.create_sequence()
        logits = m.prefill(seq, tokens, all_logits=True)
        assert logits.shape == (len(tokens), want.n_vocab)
        assert np.isfinite(logits).all()
        # Of order one (make_model.make_tensor): not collapsed to a constant, not blown up.
        assert 0.1 < float(logits.std()) < 10.0
        m.decode([seq], [int(np.argmax(logits[-1]))])
        assert np.isfinite(m.logits(seq)).all()
        m.free_sequence(seq)


def test_context_length_sets_the_positions_the_runner_accepts(write):
    path = write("smollm2-135m", 1, "q4_0", 7, context_length=16384)
    with kvsift.Model(path, n_ctx=16384, n_threads=2) as m:
        assert m.info.n_ctx_train == 16384
    with pytest.raises(kvsift.KvsiftError, match="beyond the model's 8192 positions"):
        kvsift.Model(write("smollm2-135m", 1, "q4_0", 7), n_ctx=16384, n_threads=2)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_same_seed_writes_the_same_bytes(write, qtype):
    a = write("smollm2-135m", 2, qtype, 7)
    b = write("smollm2-135m", 2, qtype, 7, again=True)
    c = write("smollm2-135m", 2, qtype, 8)
    with open(a, "rb") as fa, open(b, "rb") as fb, open(c, "rb") as fc:
        bytes_a, bytes_b, bytes_c = fa.read(), fb.read(), fc.read()
    assert bytes_a == bytes_b
    assert len(bytes_a) == len(bytes_c) and bytes_a != bytes_c


def test_the_padded_vocabulary_detokenizes_and_stays_unused(write, model_path):
    path = write("llama3.2-1b", 1, "q4_0", 7)
    with kvsift.Model(path, n_ctx=64, n_threads=2) as m, \
            kvsift.Model(model_path, n_ctx=64, n_threads=2) as smol:
        text = "Hello, world"
        np.testing.assert_array_equal(m.tokenize(text), smol.tokenize(text))
        assert m.detokenize([smol.info.n_vocab]) == b""  # the first pad token: unused, no text
        assert m.info.n_vocab > smol.info.n_vocab


@pytest.mark.parametrize("argv,message", [
    (["--shape", "llama3-9b", "--type", "q4_0", "--out", "x.gguf"], "invalid choice"),
    (["--shape", "llama3-8b", "--type", "q3_k", "--out", "x.gguf"], "invalid choice"),
    (["--shape", "llama3-8b", "--type", "q4_0", "--out", "x.gguf", "--layers", "33"],
     "not in 1..32"),
    (["--shape", "llama3-8b", "--type", "q4_0", "--out", "/no/such/folder/x.gguf"],
     "does not exist"),
    (["--shape", "llama3-8b", "--type", "q4_0", "--out", "x.gguf", "--context-length", "0"],
     "not in 1..2^32-1"),
    (["--shape", "smollm2-135m", "--type", "q4_0", "--out", "x.gguf", "--tokenizer-from",
      TOOL], "not a readable GGUF file"),
])
def test_bad_arguments_get_a_message_and_a_nonzero_exit(tmp_path, argv, message):
    run = subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode != 0
    assert message in run.stderr and "Traceback" not in run.stderr
    assert not list(tmp_path.iterdir())  # nothing written, not even OUT.part
